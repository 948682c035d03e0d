"""What computing on the GGUF file's quantized blocks buys (kernels/gguf_matmul.py): one
SmolLM2 float32 forward through the engine with the layers on their GGUF blocks against the
same layers on their dense float32 weights (prepacked oneDNN), switched in one process and
interleaved; prints the median of the runs (ms), the ratio, and the largest logit difference
and whether the argmax agrees, for one decode token, a 5-token verify chunk, 16 decode tokens
at a 250-token context and a 256-token prefill.

    python benchmarks/gguf_matmul_ab.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specmesh.engine.kv_cache import KVCache
from specmesh.engine.linear import RowInvariantLinear
from specmesh.engine.loader import load_model
from specmesh.engine.runner import ModelRunner, SeqChunk


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    torch.set_num_threads(2)
    loaded = load_model(None, dtype="float32")
    layers = [m for m in loaded.model.modules() if isinstance(m, RowInvariantLinear)]
    blocks = {id(m): (m._blocks, m._blocks_key) for m in layers}
    print(f"{sum(b is not None for b, _ in blocks.values())} of {len(layers)} layers on blocks; "
          f"{sum(b.nbytes for b, _ in blocks.values() if b is not None) / 2**20:.0f} MiB of "
          f"blocks vs {sum(m.weight.numel() * 4 for m in layers) / 2**20:.0f} MiB dense")
    bs, ctx = 16, 250
    per_seq = -(-(ctx + 260) // bs)
    cache = KVCache(loaded.config, per_seq * 16 + 4, bs, dtype="float32")
    runner = ModelRunner(loaded.model, loaded.config, cache)

    def use_blocks(on: bool) -> None:
        for m in layers:
            m._blocks, m._blocks_key = blocks[id(m)] if on else (None, None)

    def run(q_len: int, batch: int, start: int) -> list[torch.Tensor]:
        chunks = [SeqChunk([100 + (i % 7)] * q_len, start, list(range(i * per_seq,
                                                                      (i + 1) * per_seq)))
                  for i in range(batch)]
        return runner.forward(chunks, logits="last")

    print(f"SmolLM2 float32, 2 threads, median of {repeats} runs, ms")
    for q_len, batch, start in [(1, 1, ctx), (5, 1, ctx), (1, 16, ctx), (256, 1, 0)]:
        times: dict[str, list[float]] = {"blocks": [], "dense": []}
        out = {}
        for rep in range(repeats + 2 if q_len < 256 else 4):
            for name, times_of in times.items():
                use_blocks(name == "blocks")
                t0 = time.perf_counter()
                out[name] = run(q_len, batch, start)
                if rep >= 2 or q_len >= 256:
                    times_of.append(time.perf_counter() - t0)
        use_blocks(True)
        diff = max((a - b).abs().max().item() for a, b in zip(out["blocks"], out["dense"]))
        same = all(torch.equal(a.argmax(-1), b.argmax(-1))
                   for a, b in zip(out["blocks"], out["dense"]))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"q_len {q_len:3d} batch {batch:2d}: blocks {med['blocks']:7.1f}  dense "
              f"{med['dense']:7.1f}  dense/blocks {med['dense'] / med['blocks']:.2f}  "
              f"max |logit diff| {diff:.1e}  argmax equal {same}", flush=True)


if __name__ == "__main__":
    main()
