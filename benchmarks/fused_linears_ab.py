"""What fusing q/k/v and gate/up into one product each buys (engine/linear.py FusedLinears):
one SmolLM2 forward through the engine with the groups fused against each layer on its own
pack, switched in one process and interleaved; prints the median of the runs (ms), the ratio,
and whether the logits are bit-equal, for one decode token, a 5-token verify chunk and a
batch of 16 decode tokens at a 250-token context.

    python benchmarks/fused_linears_ab.py [float32|bfloat16] [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specmesh.engine import linear
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model
from specmesh.engine.runner import ModelRunner, SeqChunk


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    torch.set_num_threads(2)
    loaded = load_model(None, dtype=dtype)
    bs, ctx = 16, 250
    per_seq = -(-(ctx + 8) // bs)
    cache = KVCache(loaded.config, per_seq * 16 * bs + 4, bs, dtype=dtype)
    runner = ModelRunner(loaded.model, loaded.config, cache)
    fused = linear.FusedLinears.pack_for

    def run(q_len: int, batch: int) -> list[torch.Tensor]:
        chunks = [SeqChunk([100] * q_len, ctx, list(range(i * per_seq, (i + 1) * per_seq)))
                  for i in range(batch)]
        return runner.forward(chunks, logits="last")

    print(f"SmolLM2 {dtype}, 2 threads, context {ctx}, median of {repeats} runs, ms")
    for q_len, batch in [(1, 1), (5, 1), (1, 16)]:
        times: dict[str, list[float]] = {"fused": [], "separate": []}
        out = {}
        for rep in range(repeats + 2):
            for name, times_of in times.items():
                linear.FusedLinears.pack_for = fused if name == "fused" else \
                    (lambda self, x: None)  # each layer on its own pack
                t0 = time.perf_counter()
                out[name] = run(q_len, batch)
                if rep >= 2:  # two warm-up rounds
                    times_of.append(time.perf_counter() - t0)
        linear.FusedLinears.pack_for = fused
        equal = all(torch.equal(a, b) for a, b in zip(out["fused"], out["separate"]))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"q_len {q_len} batch {batch:2d}: fused {med['fused']:6.1f}  separate "
              f"{med['separate']:6.1f}  separate/fused {med['separate'] / med['fused']:.3f}  "
              f"logits equal {equal}", flush=True)


if __name__ == "__main__":
    main()
