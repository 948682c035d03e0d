"""Drafting cost of the shipped EAGLE head per draft depth: one ``propose`` call per request
(how the drafter drafted before) against one ``propose_many`` call for every request (one
batched head forward per round, drafter/proposers/eagle.py), interleaved in one process, at
1, 4 and 16 requests of 300 context tokens, one thread (the drafter role's default plan).

    python benchmarks/eagle_propose_batch.py [float32|bfloat16] [--steps N] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specmesh.drafter.eagle.head import EagleHead
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.proposers.eagle import EagleProposer, load_eagle_head


def _proposer(head: EagleHead, batch: int,
              context: int) -> tuple[EagleProposer, dict[str, list[int]]]:
    prop = EagleProposer(head_module=head)
    ctxs = {}
    for r in range(batch):
        ctx = [int(x) for x in torch.randint(0, 1000, (context,))]
        prop.open(f"r{r}", ctx)
        prop.observe_seed_state(f"r{r}", 0, torch.randn(context - 1, head.config.seed_width))
        ctxs[f"r{r}"] = ctx
    return prop, ctxs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dtype", nargs="?", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=24, help="draft depths timed per case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    head = load_eagle_head(None, None, dtype=args.dtype)
    for batch in (1, 4, 16):
        props = {mode: _proposer(head, batch, args.context) for mode in ("alone", "many")}
        times: dict[str, list[float]] = {"alone": [], "many": []}
        for _ in range(args.steps):
            for mode, (prop, ctxs) in props.items():  # interleaved
                t = time.perf_counter()
                if mode == "alone":
                    out = [prop.propose(rid, ctxs[rid], 1) for rid in ctxs]
                else:
                    calls = [ProposeCall(rid, ctxs[rid], 1) for rid in ctxs]
                    out = [d for d, _ in prop.propose_many(calls)]
                times[mode].append(time.perf_counter() - t)
                for rid, drafts in zip(ctxs, out):
                    ctxs[rid] = ctxs[rid] + drafts
        skip = min(4, args.steps // 4)  # the first rounds catch up on the seed states
        alone, many = (statistics.median(times[m][skip:]) * 1e3 for m in ("alone", "many"))
        print(f"{args.dtype} {batch:2d} requests: one call per request {alone:6.2f} ms, "
              f"propose_many {many:6.2f} ms per draft depth ({alone / many:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
