"""Which of llama-server's n-gram speculation types is fastest on the bundled prompts, at the
bench's kappa: one llama-server per type (drafts capped at kappa, benchmarks/harness/
llama_server.py; restarted before each pass, as the bench does, so no type drafts from its
memory of an earlier pass) and one plain, all on the bundled SmolLM2 GGUF with the bench's
thread count, each level's prompts sent to each server in turn, the order rotated per repeat.
Prints tokens/s (median), drafted / accepted tokens and outputs identical to the plain
server's.
This picked ``--llama-spec-type``'s default (docs/benchmarks.md, 'llama.cpp as the peer').

    python benchmarks/llama_spec_types.py [--kappa 4] [--concurrency 1,4] [--repeats 2]
        [--max-tokens 64] [--num-prompts N] [--types ngram-mod,ngram-simple]
        [--llama-server PATH] [--args "--spec-ngram-simple-size-n 4"]
"""

from __future__ import annotations

import argparse
import shlex
import signal
import statistics
import sys

from specmesh.benchmarks.harness.llama_server import (
    NGRAM_SPEC_TYPES,
    LlamaServers,
    find_llama_server,
    llama_configs,
)
from specmesh.benchmarks.harness.report import LLAMA_PLAIN, System
from specmesh.cluster.config import default_threads
from specmesh.cluster.runs import load_prompts, same_outputs
from specmesh.data.prompts import level_requests, parse_concurrency
from specmesh.engine.loader import load_tokenizer, model_gguf, model_name
from specmesh.gateway.tokens import chat_prompt_ids


def _interrupt(signum: int, frame) -> None:  # noqa: ANN001
    raise KeyboardInterrupt(f"signal {signum}")  # unwind: the servers started are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kappa", type=int, default=4)
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N bundled prompts")
    ap.add_argument("--types", default=",".join(NGRAM_SPEC_TYPES))
    ap.add_argument("--threads", type=int, default=default_threads()["verifier"])
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--args", default="", help="further options for every server")
    args = ap.parse_args(argv)
    binary, how = find_llama_server(args.llama_server)
    if binary is None:
        print(f"llama-server not found: {how}", file=sys.stderr)
        return 1
    levels = parse_concurrency(args.concurrency)
    prompts = load_prompts(args.num_prompts)
    tokenizer = load_tokenizer(None)
    longest = max(len(chat_prompt_ids(tokenizer, p["messages"])) for p in prompts)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    systems = [System(LLAMA_PLAIN, "llama")] + [
        System(f"{LLAMA_PLAIN} {t}", "llama", args.kappa, LLAMA_PLAIN, t) for t in types]
    configs = llama_configs(binary, str(model_gguf(None)), args.threads, levels, longest,
                            args.max_tokens, args.kappa, systems, shlex.split(args.args))
    model = model_name(None)
    runs: dict[tuple[int, str], list] = {}
    print(f"{binary} ({how}), -t {args.threads}, kappa {args.kappa}, {len(prompts)} prompts, "
          f"max_tokens {args.max_tokens}", file=sys.stderr, flush=True)
    with LlamaServers(configs) as servers:
        for name in configs:
            servers.warm_up(name, model, prompts[0]["messages"])
        for r in range(args.repeats):
            for level in levels:
                names = list(configs)
                k = r % len(names)
                for name in names[k:] + names[:k]:
                    if name != LLAMA_PLAIN:
                        servers.restart(name, model)  # no n-gram memory of earlier passes
                    res = servers.run(name, model, level_requests(prompts, level),
                                      args.max_tokens, level)
                    runs.setdefault((level, name), []).append(res)
                    print(f"repeat {r + 1} C={level} {name}: {res.tokens_per_s:.2f} tok/s, "
                          f"drafted {res.spec.num_draft_tokens}, accepted "
                          f"{res.spec.num_accepted_tokens}", file=sys.stderr, flush=True)
    for level in levels:
        plain = runs[(level, LLAMA_PLAIN)][0]
        print(f"\n## concurrency {level}\n\n| system | tokens/s | drafted | accepted | "
              f"identical to plain |\n|---|---|---|---|---|")
        for name in configs:
            rs = runs[(level, name)]
            same = same_outputs(rs[0], plain)
            tps = statistics.median(x.tokens_per_s for x in rs)
            print(f"| {name} | {tps:.2f} | {sum(x.spec.num_draft_tokens for x in rs)} | "
                  f"{sum(x.spec.num_accepted_tokens for x in rs)} | {sum(same)}/{len(same)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
