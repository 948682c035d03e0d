"""What prepacked oneDNN weights buy (engine/onednn.py): one SmolLM2 forward through the
engine with every linear product on its prepacked weight (``packed``) against ``F.linear``
(``eager``: the model loaded again with ``prepacked_linear`` off, engine/backend.py), in one
process and interleaved; Hugging Face's own forward (eager, with
its KV cache) at the same shape as a reference. Prints the median and min of 15 runs per case
(ms), eager/packed and HF/packed, for one decode token, a 5-token verify chunk and a batch of
16 decode tokens.

    python benchmarks/linear_prepack.py [bfloat16|float32] [--threads N]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dtype", nargs="?", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=250, help="tokens of KV before the step")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specmesh.benchmarks.harness.hf import load_hf_model

    runners = {}
    bs, ctx = 16, args.context
    per_seq = -(-(ctx + 8) // bs)
    for name, packed in (("packed", True), ("eager", False)):
        loaded = load_model(None, dtype=args.dtype,
                            backend=cpu_backend(BackendOverrides(prepacked_linear=packed)))
        cfg = loaded.config
        cache = KVCache(cfg, per_seq * 16 + 4, bs, dtype=args.dtype)
        runners[name] = ModelRunner(loaded.model, cfg, cache)
    hf = load_hf_model(None, args.dtype)

    def ours(name: str, q_len: int, batch: int):
        chunks = [SeqChunk([100 + i] * q_len, ctx, list(range(i * per_seq, (i + 1) * per_seq)))
                  for i in range(batch)]
        return lambda: runners[name].forward(chunks, logits="last")

    def theirs(q_len: int, batch: int):
        with torch.no_grad():
            pkv = hf(torch.full((batch, ctx), 100), use_cache=True).past_key_values
        mask = torch.ones(batch, ctx + q_len, dtype=torch.long)

        def step():
            with torch.no_grad():
                hf(torch.full((batch, q_len), 100), attention_mask=mask, past_key_values=pkv,
                   use_cache=True)
            pkv.crop(-q_len)
        return step

    print(f"SmolLM2 {args.dtype}, {args.threads} threads, context {ctx}, "
          f"median (min) of {args.repeats} runs, ms")
    for q_len, batch in [(1, 1), (5, 1), (1, 16)]:
        cases = {"packed": ours("packed", q_len, batch), "eager": ours("eager", q_len, batch),
                 "hf": theirs(q_len, batch)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for rep in range(args.repeats + 2):
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                if rep >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        low = {k: min(v) * 1e3 for k, v in times.items()}
        print(f"q_len {q_len} batch {batch:2d}: packed {med['packed']:6.1f} ({low['packed']:.1f})"
              f"  eager {med['eager']:6.1f} ({low['eager']:.1f})  hf {med['hf']:6.1f} "
              f"({low['hf']:.1f})  eager/packed {med['eager'] / med['packed']:.2f}  "
              f"hf/packed {med['hf'] / med['packed']:.2f}", flush=True)


if __name__ == "__main__":
    main()
