"""Soak under faults (issue 38): a served cluster (Ray roles, ZMQ between them, the HTTP
gateway, as ``specmesh serve`` starts it) under a mixed client load for a bounded time while a
random drafter, prefill or verifier process is killed at intervals (Ray restarts it).

The load (cluster/soak_load.py): greedy, seeded and sampled completions, streamed and not,
chat, streams the client aborts after the first token, and malformed bodies (bad JSON, a wrong
type, an oversized body). Before the load, plain greedy decode (kappa 0, in this process) gives
the reference output of every greedy prompt. After it, the roles must hold nothing; every
role's RSS is sampled through the soak (psutil on the pids the roles report).

Reports (a table on stdout, ``--json FILE``) requests served and failed by kind, the failures'
causes, greedy outputs checked and wrong, seeded outputs checked and wrong, leftovers (KV
blocks, request states), RSS growth per role after warm-up, Curve on or off; exits 1 when a
bound fails (cluster/soak_report.py: 0 wrong outputs, 0 leftovers, every failure with a cause
within 10 s, RSS growth < 5%).

Usage:
    python benchmarks/soak.py [--minutes 10] [--kill-every-s 60] [--clients 6] \
        [--model tiny|smollm2|PATH] [--secure-transport] [--json soak.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time

from specmesh.cluster.loopback import use_loopback

use_loopback()  # the embedded Ray stays on 127.0.0.1; must precede every `import ray`

import psutil  # noqa: E402
import ray  # noqa: E402

from specmesh.cluster.config import ClusterConfig  # noqa: E402
from specmesh.cluster.launcher import start_cluster  # noqa: E402
from specmesh.cluster.soak_faults import KILLABLE, RoleKiller  # noqa: E402
from specmesh.cluster.soak_load import LoadGenerator  # noqa: E402
from specmesh.cluster.soak_report import (  # noqa: E402
    RssTracker, build_report, leftovers, render)

#: completion prompts: plain greedy on the tiny model repeats itself after the latter ones, so
#: drafts are accepted
PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,",
           "Name three colors.", "a b c d e f g h", "Tell me about rivers."]
#: how long the roles may take to drop every request's state once the load ended (seconds)
LEFTOVER_WAIT_S = 30.0


def tiny_model(path: str) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer saved at ``path`` (the shape of the
    tests' tiny model, tests/conftest.py): the soak runs anywhere in seconds per request."""
    import torch  # the model build only: --help without torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.engine.loader import load_tokenizer

    tok = load_tokenizer(None)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=144,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1,
                      eos_token_id=2, pad_token_id=None)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def reference(model: str | None, prompts: list[str], max_tokens: int) -> dict:
    """Plain greedy decode (kappa 0, the in-process workers) of each prompt, as a completion
    and as a one-message chat: reference key -> output token ids."""
    from specmesh.cluster.inprocess import InProcessCluster  # the engine: torch and triton
    from specmesh.engine.loader import load_model
    from specmesh.gateway.tokens import chat_prompt_ids
    from specmesh.protocol.messages import SamplingParams

    loaded = load_model(model, dtype="float32")
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                         eos_token_ids=loaded.config.eos_token_ids)
    tok = loaded.tokenizer
    out = {}
    for p in prompts:
        for kind, ids in (("completion", list(tok(p)["input_ids"])),
                          ("chat", chat_prompt_ids(tok, [{"role": "user", "content": p}]))):
            (res,) = c.generate([ids], SamplingParams(max_tokens=max_tokens))
            out[(kind, p)] = list(res.token_ids)
    return out


def role_pids(handle) -> dict[str, int]:
    """Instance id -> pid of each role that answers now (a restarting one is left out)."""
    pids = {}
    for iid, actor in handle.actors.items():
        try:
            pids[iid] = ray.get(actor.stats.remote(), timeout=10)["pid"]
        except Exception:  # noqa: BLE001 - restarting or just killed
            continue
    return pids


def wait_idle(handle, wait_s: float) -> dict[str, int]:
    """Poll the roles' leftovers until all are zero or ``wait_s`` passed; the last reading
    (a role that does not answer in time counts as holding one request)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            left = leftovers({iid: ray.get(a.stats.remote(), timeout=20)
                              for iid, a in handle.actors.items()})
        except Exception as err:  # noqa: BLE001 - a role still restarting
            left = {"unanswered_stats": 1}
            print(f"stats: {type(err).__name__}: {err}", file=sys.stderr)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def wait_ready(handle, wait_s: float) -> bool:
    """Wait until the gateway routes to every verifier and each verifier has its peers."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            st = handle.stats()
            want = sum(iid.startswith(("prefill", "drafter")) for iid in handle.actors)
            if all(len(s["ready_peers"]) >= want for iid, s in st.items()
                   if iid.startswith("verifier")) and st["gateway-0"]["ready_verifiers"]:
                return True
        except Exception:  # noqa: BLE001 - a role still restarting
            pass
        time.sleep(0.5)
    return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    ap.add_argument("--kill-every-s", type=float, default=60.0,
                    help="seconds between kills of a random drafter/prefill/verifier (0: none)")
    ap.add_argument("--kill-roles", default=",".join(KILLABLE),
                    help="the roles the kills pick from (comma-separated)")
    ap.add_argument("--clients", type=int, default=6, help="client threads")
    ap.add_argument("--model", default="tiny",
                    help="tiny (a random 2-layer Llama, the default), smollm2 (the real model) "
                         "or a model path")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=60.0,
                    help="a role process's RSS baseline is taken this long after it started")
    ap.add_argument("--secure-transport", action="store_true",
                    help="CurveZMQ between the roles (default: plain TCP on the loopback)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the report here too")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    model = {"tiny": lambda: tiny_model(tmp.name), "smollm2": lambda: None}.get(
        args.model, lambda: args.model)()
    ref = reference(model, PROMPTS, args.max_tokens)
    cfg = ClusterConfig.create(
        model=model, dtype="float32", num_speculative_tokens=args.num_speculative_tokens,
        kv_cache_mb=64, port=0, max_model_len=1024, max_restarts=-1, namespace="specmesh-soak",
        transport="curve" if args.secure_transport else "insecure")
    handle = start_cluster(cfg)
    try:
        return soak(args, handle, ref, model)
    finally:
        handle.stop()
        tmp.cleanup()


def soak(args: argparse.Namespace, handle, ref: dict, model: str | None) -> int:
    """Run the load and the kills on a started cluster; print (and write) the report."""
    stop = threading.Event()
    load = LoadGenerator(handle.url, PROMPTS, max_tokens=args.max_tokens,
                         api_key=handle.api_key)
    loader = threading.Thread(target=load.run, args=(args.clients, stop, args.seed),
                              daemon=True)
    killer = None
    if args.kill_every_s > 0:
        roles = tuple(r for r in args.kill_roles.split(",") if r)
        targets = [iid for iid in handle.actors if iid.startswith(roles)]
        killer = RoleKiller(targets, lambda iid: ray.kill(handle.actors[iid], no_restart=False),
                            args.kill_every_s, first_after_s=min(args.kill_every_s,
                                                                 args.minutes * 30),
                            rng=random.Random(args.seed))
    rss = RssTracker(lambda pid: psutil.Process(pid).memory_info().rss, args.warmup_s)
    t0 = time.monotonic()
    loader.start()
    if killer is not None:
        killer.start(stop)
    end = t0 + args.minutes * 60
    while time.monotonic() < end:
        rss.sample(role_pids(handle), time.monotonic())
        time.sleep(min(5.0, max(0.0, end - time.monotonic())))
    stop.set()
    loader.join()
    ready = wait_ready(handle, 120.0)  # a role killed last may still be starting
    left = wait_idle(handle, LEFTOVER_WAIT_S)
    rss.sample(role_pids(handle), time.monotonic())
    st = handle.stats() if ready else {}
    meta = {"minutes": args.minutes, "model": args.model, "clients": args.clients,
            "kill_every_s": args.kill_every_s, "kill_roles": args.kill_roles,
            "max_tokens": args.max_tokens,
            "num_speculative_tokens": args.num_speculative_tokens,
            "curve": {iid: s.get("curve") for iid, s in st.items()},
            "ready_after_load": ready, "load_average": round(os.getloadavg()[0], 1),
            "kills": [vars(k) | {"at": round(k.at - t0, 1)} for k in
                      (killer.kills if killer else [])]}
    kill_times = [k.at for k in killer.kills] if killer else []
    report = build_report(load.outcomes, ref, left, rss.growth(), meta, kill_times)
    report["verdict"]["every role ready again after the load"] = ready
    report["passed"] = all(report["verdict"].values())
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
