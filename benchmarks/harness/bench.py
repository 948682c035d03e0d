"""``specmesh bench``: at each concurrency level C, the prompts through specmesh served (C
concurrent clients through the gateway; kappa = K per draft method, each method on its own
cluster, and kappa = 0 once), through the in-process specmesh workers (no Ray, no HTTP;
kappa = K per method and 0, C requests in flight), through Hugging Face batched ``generate``
(batch size C) and, at C = 1, HF with prompt lookup. Repeats, levels and systems are
interleaved in one run (machines are noisy; ratios must come from one run). Prints a table per
level and optionally writes JSON, markdown and a plot.

The draft methods are ``--drafters`` (``ngram,eagle``; default: the cluster's ``--drafter``).
Their served clusters are all started before the runs and run side by side in one Ray
session, each in its own Ray namespace (:func:`benchmarks.harness.options.namespace_for`).

Modules: options (the command's options and the compared methods), systems (served,
in-process, Hugging Face), report (counter and profile deltas, the summary), render
(markdown, plot), forward_cost (the measured forward-cost ratio of ``--profile``); the prompts
come from specmesh.data.prompts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from specmesh.benchmarks.harness.options import (
    BenchDrafter,
    BenchOptions,
    cluster_drafter,
    namespace_for,
    with_drafter,
)
from specmesh.benchmarks.harness.render import markdown, write_plot
from specmesh.benchmarks.harness.report import System, mismatch_lines, summarize, systems_for
from specmesh.benchmarks.harness.systems import (
    InProcessSystems,
    generation_eos_ids,
    load_hf_model,
    run_hf,
    run_served,
)
from specmesh.cluster.config import ClusterConfig, default_threads
from specmesh.cluster.options import is_model_drafter
from specmesh.cluster.runs import RunResult, load_prompts, openai_client, run_openai
from specmesh.data.prompts import level_requests, load_prompts_file
from specmesh.gateway.tokens import chat_prompt_ids

def bench_prompts(opts: BenchOptions) -> list[dict]:
    """The prompts of the run: the user's file or the bundled prompts, the first
    ``num_prompts`` of them."""
    prompts = load_prompts_file(opts.prompts_file) if opts.prompts_file else load_prompts()
    return prompts[:opts.num_prompts] if opts.num_prompts else prompts


def _schedule(levels: list[int], kappa: int, repeats: int,
              methods: Sequence[str] = ("ngram",),
              served_only: Sequence[str] = ()) -> list[tuple[int, int, System]]:
    """(repeat, level, system) in run order: each repeat runs every level and system (each
    method's kappa > 0 systems among them), the order of levels and of systems rotated per
    repeat."""
    out = []
    for r in range(repeats):
        lv = levels[r % len(levels):] + levels[:r % len(levels)]
        for level in lv:
            systems = systems_for(kappa, level, methods, served_only)
            k = r % len(systems)
            out += [(r, level, s) for s in systems[k:] + systems[:k]]
    return out


def _start_served(cfg: ClusterConfig, drafters: list[BenchDrafter], handle=None,
                  ) -> tuple[dict, list]:
    """One running cluster per method, all started now, side by side in one Ray session
    (each in its own namespace): (label -> handle, the handles started here). A given
    ``handle`` serves the method it runs, if listed."""
    from specmesh.cluster.launcher import start_cluster  # ray: only when clusters start

    given = cluster_drafter(handle.cfg) if handle is not None else None
    reuse = [given is not None and (given.method, given.method_kwargs) == (
        d.method, d.method_kwargs) for d in drafters]
    handles: dict = {}
    started: list = []
    try:
        for i, d in enumerate(drafters):
            if reuse[i]:
                handles[d.label] = handle
                continue
            print(f"[bench] starting the served cluster of {d.label} "
                  f"(namespace {namespace_for(d, i)})", file=sys.stderr, flush=True)
            h = start_cluster(with_drafter(cfg, d, namespace_for(d, i)),
                              num_clusters=len(drafters))  # they share the node's GPUs
            handles[d.label] = h
            started.append(h)
    except BaseException:
        for h in started:
            h.stop()
        raise
    return handles, started


def bench_process_threads(cfg: ClusterConfig) -> int:
    """Torch threads of the bench process, where the in-process systems and Hugging Face run:
    every core (the plain verifier's share, as a user's own ``generate`` would have), or the
    most a role has when the user set the plan (``--threads`` / ``--thread-plan``). A model
    drafter's default plan, which leaves its served verifier one core fewer, does not count
    as set: the baselines keep every core."""
    if cfg.threads == default_threads(model_drafter=is_model_drafter(cfg.drafter.method)):
        return default_threads()["verifier"]
    return max(cfg.threads.values())


def bench(cfg: ClusterConfig, opts: BenchOptions, handle=None) -> dict:
    """Run the bench on ``cfg`` for the methods of ``opts.drafters`` (default: ``cfg``'s),
    starting a served cluster per method (``handle``, a running
    :class:`cluster.launcher.ClusterHandle`, serves its own method when listed, and is left
    running with its kappa restored). Returns the summary
    (:func:`benchmarks.harness.report.summarize`); ``summary["mismatches"]`` lists every system
    whose output differed from kappa = 0."""
    # torch, transformers and the engine load when a bench runs, not for --help
    import torch
    from tqdm import tqdm

    from specmesh.engine.backend import cpu_backend
    from specmesh.engine.devices import resolve_device
    from specmesh.engine.loader import load_model, load_tokenizer, model_name

    prompts = bench_prompts(opts)
    kappa = cfg.verifier.num_speculative_tokens
    drafters = list(opts.drafters or [cluster_drafter(cfg)])
    labels = [d.label for d in drafters]
    served_only = [d.label for d in drafters if d.served_only]
    inproc_labels = [label for label in labels if label not in served_only]
    model = model_name(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    # each served cluster's plan (a method's default plan unless the user set one)
    plans = {d.label: with_drafter(cfg, d).threads for d in drafters}
    bench_threads = bench_process_threads(cfg)
    torch.set_num_threads(bench_threads)  # HF and in-process run here
    hf_model = load_hf_model(cfg.model, cfg.dtype)
    eos = generation_eos_ids(hf_model)
    loaded = load_model(cfg.model, dtype=cfg.dtype, device=resolve_device(cfg.device),
                        backend=cpu_backend(cfg.backend))  # the served roles' choices
    prompt_ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts]
    synthetic = cfg.verifier.synthetic_acceptance  # the ablation harness (decode/synthetic.py)
    inproc = InProcessSystems(loaded, max(len(p) for p in prompt_ids), opts.max_tokens,
                              methods={d.label: with_drafter(cfg, d) for d in drafters
                                       if not d.served_only},
                              verifier_options={"verify_rule": cfg.verifier.verify_rule,
                                                "synthetic_acceptance": synthetic,
                                                "goodput_drafts": cfg.verifier.goodput_drafts},
                              kv_cache_dtype=cfg.kv_cache_dtype)
    forward_cost: dict[str, dict] = {}  # per concurrency: its batch's forward cost ratio
    if opts.profile and kappa > 0:
        # torch and the model runner, only with --profile
        from specmesh.benchmarks.harness.forward_cost import forward_cost_ratio

        ctx = min(200, loaded.config.max_position_embeddings - kappa - 1)
        for level in opts.concurrency:
            forward_cost[str(level)] = forward_cost_ratio(
                loaded.model, loaded.config, kappa, context_len=ctx, batch=level,
                repeats=15 if level <= 4 else 7, kv_cache_dtype=cfg.kv_cache_dtype).as_dict()
    # in-process warm-up first: each method's proposer is built here, so a missing head or
    # draft model fails before any cluster starts
    for label in inproc_labels:
        inproc.run(prompt_ids[:1], kappa, 1, "warmup", label)
    inproc.run(prompt_ids[:1], 0, 1, "warmup")
    handles, started = _start_served(cfg, drafters, handle)
    served_note = (f"one cluster per draft method ({', '.join(labels)}), all started before "
                   f"the runs and running side by side in one Ray session, each in its own "
                   f"Ray namespace; served k=0 runs on the {labels[0]} cluster")
    runs: dict[int, dict[str, list[RunResult]]] = {c: {} for c in opts.concurrency}
    try:
        clients = {label: openai_client(h.url) for label, h in handles.items()}
        for label in labels:
            handles[label].set_num_speculative_tokens(kappa)
            run_openai(clients[label], model, prompts[:1], 4, "warmup")
        run_hf(hf_model, tokenizer, prompts[:1], 4, "warmup", eos)
        schedule = _schedule(opts.concurrency, kappa, opts.repeats, labels, served_only)
        bar = tqdm(schedule, desc="bench", unit="run", disable=not opts.progress,
                   file=sys.stderr)
        for r, level, system in bar:
            bar.set_postfix_str(f"C={level} {system.name}")
            reqs = level_requests(prompts, level)
            if system.kind == "served":
                label = system.method or labels[0]  # kappa = 0: the first method's cluster
                res = run_served(handles[label], clients[label], model, reqs, opts.max_tokens,
                                 system.kappa, level, system.name)
            elif system.kind == "inprocess":
                ids = level_requests(prompt_ids, level)
                res = inproc.run(ids, system.kappa, level, system.name, system.method)
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
        for h in handles.values():
            h.set_num_speculative_tokens(kappa)
        for h in started:
            h.stop()
    config = {"model": model, "dtype": cfg.dtype, "kv_cache_dtype": cfg.kv_cache_dtype,
              "kappa": kappa, "max_tokens": opts.max_tokens,
              "num_prompts": len(prompts), "prompt_names": [p["name"] for p in prompts],
              "repeats": opts.repeats, "concurrency": opts.concurrency, "threads": plans[labels[0]],
              "cluster_threads": plans,
              "bench_threads": bench_threads, "drafters": [d.as_dict() for d in drafters],
              "draft_method": drafters[0].method, "served_clusters": served_note,
              "profile": opts.profile, "verify_rule": cfg.verifier.verify_rule,
              "synthetic_acceptance": list(synthetic)}
    summary = summarize(config, runs,
                        {c: systems_for(kappa, c, labels, served_only)
                         for c in opts.concurrency},
                        forward_cost or None)
    write_outputs(summary, opts)
    return summary


def write_outputs(summary: dict, opts: BenchOptions) -> None:
    """Print the markdown tables (with profiles only under ``--profile``) and write the JSON,
    markdown and plot files the options name."""
    text = markdown(summary if opts.profile else _without_profiles(summary))
    print("\n" + text, flush=True)
    for line in mismatch_lines(summary):
        print(f"[bench] {line}", file=sys.stderr, flush=True)
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
    return dict(summary, levels=levels, forward_cost=None, forward_cost_by_level=None)
