"""Per-token cost of a SmolLM2 decode / verify forward against context length: the compiled CPU
paged attention (kernels/cpu_attention.py, what the engine runs) against the torch reference
(kernels/paged_attention.py: the model loaded again with the CPU backend's ``cpu_attention``
off, engine/backend.py, which also keeps the compiled float32 stack off), over a KV cache in
the model dtype and, with ``--kv-cache-dtype``, over a 16-bit cache of a float32 model too, all
interleaved in one process; each request's blocks are scattered through the cache as a
long-running server leaves them.

Prints per case the median (``--stat min``: the fastest) of the runs (ms per forward and per
token) of every system, and per system the ratio of the per-token time at the longest context
to that at the shortest (the "flat in context" figure: a float32 model reads twice the KV bytes
of a 16-bit cache per position, docs/benchmarks.md, 'Attention').

    python benchmarks/context_cost.py [bfloat16|float32] [--kv-cache-dtype bfloat16|float16]
        [--impls kernel,reference] [--repeats N] [--threads N] [--stat median|min]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specmesh.engine.backend import BackendOverrides, cpu_backend
from specmesh.engine.dtypes import KV_CACHE_DTYPES, dtype_name, resolve_kv_cache_dtype
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model
from specmesh.engine.runner import ModelRunner, SeqChunk

CASES = [  # (context tokens, query tokens per request, requests)
    (128, 1, 1), (2048, 1, 1), (128, 5, 1), (2048, 5, 1), (128, 1, 16), (512, 1, 16),
]
#: (query tokens, requests, shorter context, longer context) of each printed ratio
RATIOS = ((1, 1, 128, 2048), (5, 1, 128, 2048), (1, 16, 128, 512))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dtype", nargs="?", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                    help="also time a cache of this dtype (a float32 model's 16-bit cache)")
    ap.add_argument("--impls", default="kernel,reference",
                    help="comma list of attention implementations: kernel, reference")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--stat", default="median", choices=("median", "min"),
                    help="per case: the median of the repeats, or the fastest (on cores other "
                         "work shares, the least disturbed)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    impls = ("kernel", "reference")
    chosen = [name.strip() for name in args.impls.split(",")]
    if not chosen or any(name not in impls for name in chosen):
        raise SystemExit(f"--impls takes a comma list of {impls}, got {args.impls!r}")
    torch.set_num_threads(args.threads)
    bs = 16
    need = max(b * -(-(c + q) // bs) for c, q, b in CASES)
    model_dtype = load_model(None, dtype=args.dtype).model.dtype
    kv_dtypes = [model_dtype]
    extra = resolve_kv_cache_dtype(args.kv_cache_dtype, model_dtype)
    if extra not in kv_dtypes:
        kv_dtypes.append(extra)
    # (label, runner) per system; a model of its own per system: the compiled stack rebuilds
    # its pointers whenever its model's forward gets another cache, which would add that cost
    # to every step here
    systems = []
    for dt in kv_dtypes:
        for name in chosen:
            loaded = load_model(None, dtype=args.dtype, backend=cpu_backend(
                BackendOverrides(cpu_attention=name == "kernel")))
            cache = KVCache(loaded.config, need + 8, bs, dtype=dt)
            systems.append((f"{name} {dtype_name(dt)} KV",
                            ModelRunner(loaded.model, loaded.config, cache)))
    order = torch.randperm(need + 8, generator=torch.Generator().manual_seed(0)).tolist()

    def run(runner: ModelRunner, ctx: int, q_len: int, batch: int) -> None:
        nb = -(-(ctx + q_len) // bs)
        chunks = [SeqChunk([100 + i] * q_len, ctx, order[i * nb:(i + 1) * nb])
                  for i in range(batch)]
        runner.forward(chunks, logits="last")

    times = {c: {label: [] for label, _ in systems} for c in CASES}
    with torch.inference_mode():
        for rep in range(args.repeats + 2):
            for case in CASES:
                for label, runner in systems:
                    t = time.perf_counter()
                    run(runner, *case)
                    if rep >= 2:  # two warm-up rounds
                        times[case][label].append(time.perf_counter() - t)
    labels = [label for label, _ in systems]
    print(f"SmolLM2 {args.dtype}, {args.threads} threads, {args.stat} of {args.repeats} "
          f"(ms per forward / ms per token)")
    print(f"{'context':>8} {'q':>2} {'batch':>5} | " + " | ".join(f"{s:>19}" for s in labels))
    stat = statistics.median if args.stat == "median" else min
    med = {c: {k: stat(v) * 1e3 for k, v in times[c].items()} for c in CASES}
    for (ctx, q, b) in CASES:
        cells = " | ".join(f"{med[(ctx, q, b)][k]:8.2f} / {med[(ctx, q, b)][k] / b:8.2f}"
                           for k in labels)
        print(f"{ctx:>8} {q:>2} {b:>5} | {cells}")
    for q, b, short, long in RATIOS:
        ratio = {k: med[(long, q, b)][k] / med[(short, q, b)][k] for k in labels}
        print(f"per-token time, context {long} / {short} ({q} query tokens, batch {b}): "
              + ", ".join(f"{k} {r:.3f}" for k, r in ratio.items()))


if __name__ == "__main__":
    main()
