"""Load time of the real model: first load (GGUF dequantized, then cached as safetensors) versus
a cached load, measured side by side in one run with a fresh cache directory.

    python benchmarks/model_load.py [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
