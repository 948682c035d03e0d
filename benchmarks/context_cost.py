"""Per-token cost of a SmolLM2 decode / verify forward against context length: the compiled CPU
paged attention (kernels/cpu_attention.py, what the engine runs) against the torch reference
(kernels/paged_attention.py: the model loaded again with the CPU backend's ``cpu_attention``
off, engine/backend.py, which also keeps the compiled float32 stack off), interleaved in one
process; each request's blocks are scattered through the cache as a long-running server
leaves them.

Prints per case the median of the runs (ms per forward and per token) for both, and the ratio
of the per-token time at the longest context to that at the shortest (the issue's "flat in
context" figure).

    python benchmarks/context_cost.py [bfloat16|float32] [--repeats N] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specmesh.engine.backend import BackendOverrides, cpu_backend
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model
from specmesh.engine.runner import ModelRunner, SeqChunk

CASES = [  # (context tokens, query tokens per request, requests)
    (128, 1, 1), (2048, 1, 1), (128, 5, 1), (2048, 5, 1), (128, 1, 16), (512, 1, 16),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dtype", nargs="?", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bs = 16
    need = max(b * -(-(c + q) // bs) for c, q, b in CASES)
    impls = {}
    for name, kernel in (("kernel", True), ("reference", False)):
        loaded = load_model(None, dtype=args.dtype,
                            backend=cpu_backend(BackendOverrides(cpu_attention=kernel)))
        cache = KVCache(loaded.config, need + 8, bs, dtype=args.dtype)
        impls[name] = ModelRunner(loaded.model, loaded.config, cache)
    order = torch.randperm(need + 8, generator=torch.Generator().manual_seed(0)).tolist()

    def run(runner: ModelRunner, ctx: int, q_len: int, batch: int) -> None:
        nb = -(-(ctx + q_len) // bs)
        chunks = [SeqChunk([100 + i] * q_len, ctx, order[i * nb:(i + 1) * nb])
                  for i in range(batch)]
        runner.forward(chunks, logits="last")

    times: dict[tuple, dict[str, list[float]]] = {c: {k: [] for k in impls} for c in CASES}
    with torch.inference_mode():
        for rep in range(args.repeats + 2):
            for case in CASES:
                for name, runner in impls.items():
                    t = time.perf_counter()
                    run(runner, *case)
                    if rep >= 2:  # two warm-up rounds
                        times[case][name].append(time.perf_counter() - t)
    print(f"SmolLM2 {args.dtype}, {args.threads} threads, median of {args.repeats} "
          f"(ms per forward / ms per token)")
    print(f"{'context':>8} {'q':>2} {'batch':>5} | {'kernel':>15} | {'reference':>15}")
    med = {c: {k: statistics.median(v) * 1e3 for k, v in times[c].items()} for c in CASES}
    for (ctx, q, b) in CASES:
        cells = " | ".join(f"{med[(ctx, q, b)][k]:6.1f} / {med[(ctx, q, b)][k] / b:6.2f}"
                           for k in impls)
        print(f"{ctx:>8} {q:>2} {b:>5} | {cells}")
    for q, b, short, long in ((1, 1, 128, 2048), (5, 1, 128, 2048), (1, 16, 128, 512)):
        ratio = {k: med[(long, q, b)][k] / med[(short, q, b)][k] for k in impls}
        print(f"per-token time, context {long} / {short} ({q} query tokens, batch {b}): "
              + ", ".join(f"{k} {r:.3f}" for k, r in ratio.items()))


if __name__ == "__main__":
    main()
