"""``specmesh demo``: start the cluster, run the bundled prompts through the gateway over HTTP
with the official ``openai`` client, speculation on (kappa > 0) and off (kappa = 0) on the same
cluster, and print a table. The two runs are interleaved prompt by prompt (on, off; then off,
on for the next prompt), so a machine whose load changes during the demo slows both alike and
the ratio stays a side-by-side one."""

from __future__ import annotations

import time

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.runs import (
    RunResult,
    load_prompts,
    openai_client,
    run_openai,
    same_outputs,
)


def warm_up(client, model: str, prompts: list[dict], handle, kappa: int,  # noqa: ANN001
            max_tokens: int = 8) -> None:
    """One short untimed request with speculation off, then on, as the timed runs will use
    the cluster: the first requests of a fresh cluster pay one-off costs (lazy kernel
    loads, first page faults of the weights, the scheduler's first cost measurements) that
    would otherwise all land on the speculative run, which goes first."""
    handle.set_num_speculative_tokens(0)
    run_openai(client, model, prompts[:1], max_tokens, "warmup")
    handle.set_num_speculative_tokens(kappa)
    run_openai(client, model, prompts[:1], max_tokens, "warmup")


def interleaved(client, model: str, prompts: list[dict], max_tokens: int,  # noqa: ANN001
                handle, kappa: int) -> tuple[RunResult, RunResult]:  # noqa: ANN001
    """(speculative, kappa=0) runs over ``prompts``, one prompt at a time through both, the
    order alternating per prompt (on then off, off then on), the cluster's kappa switched
    before each request and left at ``kappa``. Each run sums its own requests' times."""
    runs = {kappa: RunResult("speculative"), 0: RunResult("kappa=0")}
    ids: dict[int, list] = {kappa: [], 0: []}
    try:
        for i, p in enumerate(prompts):
            for k in ((kappa, 0) if i % 2 == 0 else (0, kappa)):
                handle.set_num_speculative_tokens(k)
                one = run_openai(client, model, [p], max_tokens, runs[k].system, show=k > 0)
                run = runs[k]
                run.seconds += one.seconds
                run.num_tokens += one.num_tokens
                run.spec.add(one.spec)
                run.texts += one.texts
                ids[k].append(one.token_ids[0] if one.token_ids else None)
    finally:
        handle.set_num_speculative_tokens(kappa)
    for k, run in runs.items():
        run.token_ids = None if None in ids[k] else ids[k]
    return runs[kappa], runs[0]


def demo(cfg: ClusterConfig, num_prompts: int | None = None, max_tokens: int = 96) -> dict:
    """Start the cluster, run the prompts with speculation on and off, print a table.
    Returns both runs, the speedup and how many completions were identical."""
    # ray (after the CLI's use_loopback) and the engine's model (triton kernels)
    from specmesh.cluster.launcher import start_cluster
    from specmesh.engine.loader import model_name

    prompts = load_prompts(num_prompts)
    kappa = cfg.verifier.num_speculative_tokens
    model = model_name(cfg.model)
    print(f"[specmesh] starting cluster: model {model}, dtype {cfg.dtype}, "
          f"num_speculative_tokens {kappa}, threads {cfg.threads}", flush=True)
    t0 = time.perf_counter()
    handle = start_cluster(cfg)
    print(f"[specmesh] cluster up in {time.perf_counter() - t0:.1f} s; gateway {handle.url}",
          flush=True)
    try:
        client = openai_client(handle.url, handle.api_key)
        warm_up(client, model, prompts, handle, kappa)
        spec, plain = interleaved(client, model, prompts, max_tokens, handle, kappa)
    finally:
        handle.stop()
    same = sum(same_outputs(spec, plain))
    print("\n| run | tokens | seconds | tokens/s | acceptance rate | mean accept length |")
    print("|---|---|---|---|---|---|")
    for r in (spec, plain):
        print(f"| {r.system} | {r.num_tokens} | {r.seconds:.2f} | {r.tokens_per_s:.2f} | "
              f"{r.spec.acceptance_rate:.2f} | {r.spec.mean_accept_len:.2f} |")
    ratio = spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
    print(f"\nspeedup of speculation: {ratio:.2f}x; identical completions with and without "
          f"speculation: {same}/{len(prompts)}")
    return {"speculative": spec.as_dict(), "plain": plain.as_dict(), "speedup": ratio,
            "identical": same}
