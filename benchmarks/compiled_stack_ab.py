"""What running the decoder layers as one compiled call buys (engine/compiled_stack.py): one
SmolLM2 float32 forward (GGUF blocks) with the compiled call against the layer-by-layer path
(the model loaded again with the CPU backend's ``compiled_stack`` off, engine/backend.py), in
one process and interleaved; prints the medians
(ms), their ratio and whether the logits are the same bits, for one decode token, a 5-token
verify chunk and 16 decode tokens (16 requests), at 250 positions of context.

    python benchmarks/compiled_stack_ab.py [REPEATS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specmesh.engine import compiled_stack
from specmesh.engine.backend import BackendOverrides, cpu_backend
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.loader import load_model
from specmesh.engine.runner import ModelRunner, SeqChunk


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    torch.set_num_threads(2)
    bs, ctx = 16, 250
    per_seq = -(-(ctx + 260) // bs)
    runners = {}
    for switch in ("1", "0"):  # compiled, layer by layer
        loaded = load_model(None, dtype="float32", backend=cpu_backend(
            BackendOverrides(compiled_stack=switch == "1")))
        cache = KVCache(loaded.config, per_seq * 16 + 4, bs, dtype="float32")
        runners[switch] = ModelRunner(loaded.model, loaded.config, cache)
    ran: list[bool] = []
    real = compiled_stack.CompiledStack.run

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202
        out = real(self, *args, **kwargs)
        ran.append(out is not None)
        return out

    compiled_stack.CompiledStack.run = counted

    def run(switch: str, q_len: int, batch: int) -> list[torch.Tensor]:
        return runners[switch].forward([SeqChunk([100 + i] * q_len, ctx,
                                        list(range(i * per_seq, (i + 1) * per_seq)))
                               for i in range(batch)], logits="last")

    print(f"SmolLM2 float32, 2 threads, {ctx} positions, median of {repeats} runs, ms")
    for q_len, batch in ((1, 1), (5, 1), (1, 16)):
        times: dict[str, list[float]] = {"1": [], "0": []}
        out = {}
        for rep in range(repeats + 2):
            for switch, times_of in times.items():
                ran.clear()
                t0 = time.perf_counter()
                out[switch] = run(switch, q_len, batch)
                if rep >= 2:
                    times_of.append(time.perf_counter() - t0)
                assert ran == [switch == "1"], "the compiled call did not run as switched"
        same = all(torch.equal(a, b) for a, b in zip(out["1"], out["0"]))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"q_len {q_len} batch {batch:2d}: compiled {med['1']:6.1f}  layer by layer "
              f"{med['0']:6.1f}  ratio {med['0'] / med['1']:.2f}  same bits {same}", flush=True)


if __name__ == "__main__":
    main()
