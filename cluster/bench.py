"""``specmesh bench``: at each concurrency level C, the prompts through specmesh served (C
concurrent clients through the gateway; kappa = K and kappa = 0 on the same cluster), through
the in-process specmesh workers (no Ray, no HTTP; kappa = K and 0, C requests in flight),
through Hugging Face batched ``generate`` (batch size C) and, at C = 1, HF with prompt lookup.
Repeats, levels and systems are interleaved in one run (machines are noisy; ratios must come
from one run). Prints a table per level and optionally writes JSON, markdown and a plot.

Modules: bench_prompts (inputs), bench_served / bench_inprocess / bench_hf (the systems),
bench_stats (counter and profile deltas), bench_report (summary, markdown, plot).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from cluster.bench_hf import generation_eos_ids, load_hf_model, run_hf
from cluster.bench_prompts import level_requests, load_prompts_file
from cluster.bench_report import System, markdown, summarize, systems_for, write_plot
from cluster.config import ClusterConfig
from cluster.runs import RunResult, load_prompts, openai_client, run_openai

__all__ = ["BenchOptions", "bench", "load_hf_model"]


@dataclass
class BenchOptions:
    """What one bench run does. ``concurrency``: the levels (clients / batch size);
    ``max_tokens``: completion tokens per request; ``num_prompts``: the first N prompts (of
    ``prompts_file`` when given, else the bundled ones); ``profile``: print the verifier step
    profiles and measure the forward-cost ratio; ``*_path``: outputs (None: not written)."""

    concurrency: list[int] = field(default_factory=lambda: [1])
    repeats: int = 3
    max_tokens: int = 64
    num_prompts: int | None = None
    prompts_file: str | None = None
    profile: bool = False
    json_path: str | None = None
    markdown_path: str | None = None
    plot_path: str | None = None
    progress: bool = True


def bench_prompts(opts: BenchOptions) -> list[dict]:
    """The prompts of the run: the user's file or the bundled prompts, the first
    ``num_prompts`` of them."""
    prompts = load_prompts_file(opts.prompts_file) if opts.prompts_file else load_prompts()
    return prompts[:opts.num_prompts] if opts.num_prompts else prompts


def _schedule(levels: list[int], kappa: int, repeats: int) -> list[tuple[int, int, System]]:
    """(repeat, level, system) in run order: each repeat runs every level and system, the
    order of levels and of systems rotated per repeat."""
    out = []
    for r in range(repeats):
        lv = levels[r % len(levels):] + levels[:r % len(levels)]
        for level in lv:
            systems = systems_for(kappa, level)
            k = r % len(systems)
            out += [(r, level, s) for s in systems[k:] + systems[:k]]
    return out


def bench(cfg: ClusterConfig, opts: BenchOptions, handle=None) -> dict:
    """Run the bench on ``cfg`` (starting a cluster unless ``handle``, a running
    :class:`cluster.launcher.ClusterHandle`, is given; a given one is left running with its
    kappa restored). Returns the summary (:func:`cluster.bench_report.summarize`)."""
    import torch
    from tqdm import tqdm

    from cluster.bench_inprocess import InProcessSystems
    from cluster.bench_served import run_served
    from cluster.gateway.tokens import chat_prompt_ids
    from engine.devices import resolve_device
    from engine.loader import load_model, load_tokenizer, model_name

    prompts = bench_prompts(opts)
    kappa = cfg.verifier.num_speculative_tokens
    model = model_name(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    torch.set_num_threads(cfg.threads.get("verifier", 2))  # HF and in-process run here
    hf_model = load_hf_model(cfg.model, cfg.dtype)
    eos = generation_eos_ids(hf_model)
    loaded = load_model(cfg.model, dtype=cfg.dtype, device=resolve_device(cfg.device))
    prompt_ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts]
    inproc = InProcessSystems(loaded, max(len(p) for p in prompt_ids), opts.max_tokens)
    forward_cost = None
    if opts.profile and kappa > 0:
        from cluster.forward_cost import forward_cost_ratio

        ctx = min(200, loaded.config.max_position_embeddings - kappa - 1)
        forward_cost = forward_cost_ratio(loaded.model, loaded.config, kappa,
                                          context_len=ctx).as_dict()
    own = handle is None
    if own:
        from cluster.launcher import start_cluster

        handle = start_cluster(cfg)
    runs: dict[int, dict[str, list[RunResult]]] = {c: {} for c in opts.concurrency}
    try:
        client = openai_client(handle.url)
        run_openai(client, model, prompts[:1], 4, "warmup")
        inproc.run(prompt_ids[:1], kappa, 1, "warmup")
        run_hf(hf_model, tokenizer, prompts[:1], 4, "warmup", eos)
        schedule = _schedule(opts.concurrency, kappa, opts.repeats)
        bar = tqdm(schedule, desc="bench", unit="run", disable=not opts.progress,
                   file=sys.stderr)
        for r, level, system in bar:
            bar.set_postfix_str(f"C={level} {system.name}")
            reqs = level_requests(prompts, level)
            if system.kind == "served":
                res = run_served(handle, client, model, reqs, opts.max_tokens, system.kappa,
                                 level, system.name)
            elif system.kind == "inprocess":
                ids = level_requests(prompt_ids, level)
                res = inproc.run(ids, system.kappa, level, system.name)
            else:
                res = run_hf(hf_model, tokenizer, reqs, opts.max_tokens, system.name, eos,
                             batch_size=1 if system.kappa else level,
                             prompt_lookup=system.kappa or None)
            runs[level].setdefault(system.name, []).append(res)
            tqdm.write(f"[bench] repeat {r + 1}/{opts.repeats} C={level} {system.name}: "
                       f"{res.num_tokens} tokens in {res.seconds:.2f} s, "
                       f"{res.tokens_per_s:.2f} tok/s", file=sys.stderr)
        bar.close()
    finally:
        handle.set_num_speculative_tokens(kappa)
        if own:
            handle.stop()
    config = {"model": model, "dtype": cfg.dtype, "kappa": kappa, "max_tokens": opts.max_tokens,
              "num_prompts": len(prompts), "prompt_names": [p["name"] for p in prompts],
              "repeats": opts.repeats, "concurrency": opts.concurrency, "threads": cfg.threads,
              "draft_method": cfg.verifier.draft_method, "profile": opts.profile}
    summary = summarize(config, runs, {c: systems_for(kappa, c) for c in opts.concurrency},
                        forward_cost)
    write_outputs(summary, opts)
    return summary


def write_outputs(summary: dict, opts: BenchOptions) -> None:
    """Print the markdown tables (with profiles only under ``--profile``) and write the JSON,
    markdown and plot files the options name."""
    text = markdown(summary if opts.profile else _without_profiles(summary))
    print("\n" + text, flush=True)
    if opts.json_path:
        with open(opts.json_path, "w") as f:
            json.dump(summary, f, indent=2)
    if opts.markdown_path:
        with open(opts.markdown_path, "w") as f:
            f.write(text + "\n")
    if opts.plot_path:
        write_plot(summary, opts.plot_path)


def _without_profiles(summary: dict) -> dict:
    levels = {}
    for key, lv in summary["levels"].items():
        systems = {n: {k: v for k, v in s.items() if k not in ("profile", "step_cost")}
                   for n, s in lv["systems"].items()}
        levels[key] = dict(lv, systems=systems)
    return dict(summary, levels=levels, forward_cost=None)
