"""Time to first token under a bounded concurrent load, against any OpenAI-compatible server.

C client threads (the official ``openai`` client, streaming ``/v1/completions``) each send the
next request as soon as their previous one finished, until N requests are done; every prompt is
``--prompt-tokens`` random token ids from its own seed (no two prompts share a prefix, so a
server's prompt cache cannot help; the seeds come from the clock unless ``--seed`` is given, so
a second run sends new prompts too), greedy, ``--max-tokens`` output tokens with ``ignore_eos``.
This is the shape of ``guidellm``'s synthetic concurrent benchmark (docs/benchmarks.md, 'Time to
first token'); the script exists so the same load runs without installing guidellm.

TTFT is the time from sending the request to the first streamed chunk carrying output; output
tokens/s is completion tokens over the wall time of the timed requests (after one warm-up
request). With ``--metrics URL`` (specmesh's gateway ``/metrics``), the TTFT parts the
verifier and prefill record (``ttft_*`` and prefill phases of the step profile) are read
before and after the run and their means over the run are printed too.

With ``--servers NAME=URL,...`` it compares servers on a noisy host instead: ``--blocks``
interleaved blocks, each running the load against every server in turn, and reports per server
the median over blocks (with the TTFT parts of a server that has specmesh's ``/metrics``).

Usage:
    python benchmarks/ttft_load.py --url http://127.0.0.1:8000 --concurrency 4 --requests 16 \
        [--metrics http://127.0.0.1:8000/metrics] [--json out.json]
    python benchmarks/ttft_load.py --servers specmesh=http://127.0.0.1:8000,\
llama=http://127.0.0.1:8080 --concurrency 4 --requests 8 --blocks 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import urllib.request

from specmesh.cluster.security_options import API_KEY_ENV

#: token ids prompts are drawn from: ordinary vocabulary of SmolLM2 (no special tokens)
TOKEN_RANGE = (1000, 20000)


def prompt_ids(seed: int, n: int) -> list[int]:
    """``n`` random token ids of ``seed`` (the same prompt for the same seed)."""
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def model_name(client) -> str:
    """The first model the server lists."""
    return client.models.list().data[0].id


def one_request(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Stream one completion; returns ttft_s, e2e_s and the output tokens counted."""
    t0 = time.perf_counter()
    ttft = None
    chunks = 0
    usage = None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and (chunk.choices[0].text or "") and ttft is None:
            ttft = time.perf_counter() - t0
        if chunk.choices and chunk.choices[0].text:
            chunks += 1
    e2e = time.perf_counter() - t0
    tokens = usage.completion_tokens if usage is not None else chunks
    return {"ttft_s": ttft if ttft is not None else e2e, "e2e_s": e2e, "tokens": tokens}


def run_load(url: str, concurrency: int, num_requests: int, prompt_tokens: int,
             max_tokens: int, seed: int = 0) -> dict:
    """Warm up with one request, then run ``num_requests`` from ``concurrency`` threads."""
    from openai import OpenAI  # openai: a client-side extra, needed only to send load

    # a specmesh server started with --api-key: the key from the variable it reads too
    client = OpenAI(base_url=f"{url}/v1", api_key=os.environ.get(API_KEY_ENV) or "none",
                    timeout=600, max_retries=0)
    model = model_name(client)
    one_request(client, model, prompt_ids(seed - 1, prompt_tokens), max_tokens)
    results: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(num_requests))

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = one_request(client, model, prompt_ids(seed + 1000 + i, prompt_tokens),
                            max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft_s"] * 1e3 for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "num_requests": len(results),
            "ttft_mean_ms": statistics.fmean(ttfts),
            "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p90_ms": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "ttft_max_ms": ttfts[-1],
            "output_tokens_per_s": tokens / wall, "wall_s": wall}


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of every sample at a Prometheus text endpoint."""
    key = os.environ.get(API_KEY_ENV)  # a server with --protect-metrics needs it
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


#: the step-profile phases that make up a request's TTFT on the served path (verifier:
#: ttft_admission_wait, ttft_prefill, ttft, kv_transfer, kv_ingest, prefill_pause, forward;
#: prefill: queue_wait, forward, send_kv)
TTFT_PHASES = ("ttft_admission_wait", "ttft_prefill", "ttft", "kv_transfer", "kv_ingest",
               "prefill_pause", "queue_wait", "forward", "send_kv")
#: the gateway's own TTFT histogram (arrival at the gateway to the first token it streams)
GATEWAY_TTFT = "specmesh:time_to_first_token_seconds"


def phase_means(before: dict[str, float], after: dict[str, float]) -> dict[str, dict]:
    """Mean and count over the run of every step-profile phase in :data:`TTFT_PHASES`, per
    role (from ``specmesh:step_phase_seconds_{sum,count}`` with ``role`` / ``phase``
    labels)."""
    out: dict[str, dict] = {}
    for key, value in after.items():
        if not key.startswith("specmesh:step_phase_seconds_count{"):
            continue
        labels = key[key.index("{"):]
        phase = _label(labels, "phase")
        if phase not in TTFT_PHASES:
            continue
        count = value - before.get(key, 0.0)
        total = after.get("specmesh:step_phase_seconds_sum" + labels, 0.0) \
            - before.get("specmesh:step_phase_seconds_sum" + labels, 0.0)
        if count > 0:
            name = f"{_label(labels, 'role')} {phase}"
            prev = out.get(name, {"count": 0.0, "total_ms": 0.0})
            prev["count"] += count
            prev["total_ms"] += total * 1e3
            out[name] = prev
    count = _summed(after, GATEWAY_TTFT + "_count") - _summed(before, GATEWAY_TTFT + "_count")
    if count > 0:
        total = _summed(after, GATEWAY_TTFT + "_sum") - _summed(before, GATEWAY_TTFT + "_sum")
        out["gateway ttft"] = {"count": count, "total_ms": total * 1e3}
    for v in out.values():
        v["mean_ms"] = v["total_ms"] / v["count"]
    return out


def _summed(samples: dict[str, float], name: str) -> float:
    """The sum of every sample of series ``name`` (whatever its labels)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def _label(labels: str, name: str) -> str:
    for part in labels.strip("{}").split(","):
        k, _, v = part.partition("=")
        if k == name:
            return v.strip('"')
    return ""


def compare(servers: dict[str, str], blocks: int, concurrency: int, num_requests: int,
            prompt_tokens: int, max_tokens: int, seed: int) -> dict:
    """Interleaved blocks on a noisy host: each block runs the load against every server in
    turn (new prompts each time), so every server sees the same minutes; per server the
    block means, their median, the median output tokens/s and, where the server has specmesh's
    ``/metrics``, the TTFT parts over all its blocks."""
    metrics = {}
    for name, url in servers.items():
        try:
            metrics[name] = scrape(f"{url}/metrics")
        except OSError:  # not specmesh (or no metrics): TTFT from the client only
            pass
    out: dict = {name: {"block_ttft_mean_ms": [], "block_ttft_p50_ms": [],
                        "block_tokens_per_s": []} for name in servers}
    loads = []
    for block in range(blocks):
        for name, url in servers.items():
            loads.append(os.getloadavg()[0])
            r = run_load(url, concurrency, num_requests, prompt_tokens, max_tokens, seed)
            seed += 10 * num_requests + 10
            o = out[name]
            o["block_ttft_mean_ms"].append(round(r["ttft_mean_ms"], 1))
            o["block_ttft_p50_ms"].append(round(r["ttft_p50_ms"], 1))
            o["block_tokens_per_s"].append(round(r["output_tokens_per_s"], 2))
            print(f"block {block} {name}: TTFT mean {r['ttft_mean_ms']:.0f} ms, p50 "
                  f"{r['ttft_p50_ms']:.0f} ms, {r['output_tokens_per_s']:.1f} tok/s, "
                  f"load {loads[-1]:.1f}", file=sys.stderr, flush=True)
    for name, o in out.items():
        o["median_ttft_mean_ms"] = statistics.median(o["block_ttft_mean_ms"])
        o["median_ttft_p50_ms"] = statistics.median(o["block_ttft_p50_ms"])
        o["median_tokens_per_s"] = statistics.median(o["block_tokens_per_s"])
        if name in metrics:
            o["phases"] = phase_means(metrics[name], scrape(f"{servers[name]}/metrics"))
    return {"concurrency": concurrency, "requests_per_block": num_requests, "blocks": blocks,
            "loadavg_1m": [min(loads), max(loads)], "servers": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="", help="server root, e.g. http://127.0.0.1:8000")
    ap.add_argument("--servers", default="", metavar="NAME=URL,...",
                    help="compare these servers in interleaved blocks instead")
    ap.add_argument("--blocks", type=int, default=4, help="with --servers: blocks per server")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="requests per run (per block)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=None,
                    help="first prompt seed (default: from the clock, new prompts every run)")
    ap.add_argument("--metrics", default="", help="specmesh gateway /metrics URL (optional)")
    ap.add_argument("--json", default="", help="also write the result here")
    args = ap.parse_args()
    if bool(args.url) == bool(args.servers):
        ap.error("give --url or --servers")
    seed = args.seed if args.seed is not None else time.time_ns() % (1 << 40)
    if args.servers:
        servers = dict(item.split("=", 1) for item in args.servers.split(","))
        res = compare(servers, args.blocks, args.concurrency, args.requests,
                      args.prompt_tokens, args.max_tokens, seed)
    else:
        before = scrape(args.metrics) if args.metrics else {}
        load_before = os.getloadavg()[0]
        res = run_load(args.url, args.concurrency, args.requests, args.prompt_tokens,
                       args.max_tokens, seed)
        res["loadavg_1m"] = [load_before, os.getloadavg()[0]]
        if args.metrics:
            res["phases"] = phase_means(before, scrape(args.metrics))
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
