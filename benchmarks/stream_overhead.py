"""Does streaming (SSE) slow specmesh's served system? ``specmesh bench`` streams every served
request to time its TTFT and inter-token latency; this runs the same served passes (kappa = K
and 0, the bundled prompts, C concurrent clients) streamed and not streamed on one cluster,
interleaved, and prints tokens/s of both and their ratio, with the streamed TTFT / ITL.

    python benchmarks/stream_overhead.py [--concurrency 1,4] [--repeats 3] [--max-tokens 64]
        [--num-prompts N] [--dtype float32 --drafter ngram ...: any cluster option]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys


def _interrupt(signum: int, frame) -> None:  # noqa: ANN001
    raise KeyboardInterrupt(f"signal {signum}")  # unwind: the servers started are stopped


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    # the cluster's modules load once the signal handler is set (ray is imported after loopback)
    from specmesh.cluster.loopback import use_loopback
    from specmesh.cluster.options import add_cluster_options, cluster_config
    from specmesh.data.prompts import level_requests, parse_concurrency

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cluster_options(ap)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N bundled prompts")
    args = ap.parse_args(argv)
    levels = parse_concurrency(args.concurrency)
    use_loopback()  # before the first `import ray`
    # ray, torch and the engine: only after use_loopback
    from specmesh.benchmarks.harness.report import latency_summary
    from specmesh.benchmarks.harness.systems import run_served
    from specmesh.cluster.launcher import start_cluster
    from specmesh.cluster.runs import load_prompts, openai_client, run_openai, same_outputs
    from specmesh.engine.loader import model_name

    cfg = cluster_config(args, port=0)
    kappa = cfg.verifier.num_speculative_tokens
    prompts = load_prompts(args.num_prompts)
    model = model_name(cfg.model)
    handle = start_cluster(cfg)
    runs: dict[tuple[int, int, bool], list] = {}
    try:
        client = openai_client(handle.url)
        run_openai(client, model, prompts[:1], 4, "warmup")
        passes = [(k, s) for k in (kappa, 0) for s in (True, False)]
        for r in range(args.repeats):
            for level in levels:
                order = passes[r % len(passes):] + passes[:r % len(passes)]
                for k, stream in order:
                    res = run_served(handle, client, model, level_requests(prompts, level),
                                     args.max_tokens, k, level, f"k={k}", stream=stream)
                    runs.setdefault((level, k, stream), []).append(res)
                    print(f"repeat {r + 1} C={level} k={k} "
                          f"{'streamed' if stream else 'not streamed'}: "
                          f"{res.tokens_per_s:.2f} tok/s", file=sys.stderr, flush=True)
    finally:
        handle.set_num_speculative_tokens(kappa)
        handle.stop()
    print(f"load average at the end: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    print("\n| C | kappa | streamed tok/s | not streamed tok/s | streamed / not | identical | "
          "TTFT p50 ms | ITL p50 ms |\n|---|---|---|---|---|---|---|---|")
    for level in levels:
        for k in (kappa, 0):
            on, off = runs[(level, k, True)], runs[(level, k, False)]
            med_on = statistics.median(x.tokens_per_s for x in on)
            med_off = statistics.median(x.tokens_per_s for x in off)
            same = same_outputs(on[0], off[0])
            lat = latency_summary(on)
            print(f"| {level} | {k} | {med_on:.2f} | {med_off:.2f} | {med_on / med_off:.2f}x | "
                  f"{sum(same)}/{len(same)} | {lat['ttft_ms']['p50']:.1f} | "
                  f"{lat['itl_ms']['p50']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
