"""``specmesh bench``: at each concurrency level C, the prompts through specmesh served (C
concurrent clients through the gateway; kappa = K per draft method, each method on its own
cluster, and kappa = 0 once), through the in-process specmesh workers (no Ray, no HTTP;
kappa = K per method and 0, C requests in flight), through Hugging Face batched ``generate``
(batch size C) and, at C = 1, HF with prompt lookup, and with ``--baselines llama-server``
through llama.cpp's ``llama-server`` plain and with its n-gram speculation (the same GGUF,
threads and clients; benchmarks/harness/llama_server.py). Served and llama-server requests
are streamed, so each records its TTFT and inter-token latency. Repeats, levels and systems
are interleaved in one run (machines are noisy; ratios must come from one run). Prints a
table per level and optionally writes JSON, markdown and a plot.

The draft methods are ``--drafters`` (``ngram,eagle``; default: the cluster's ``--drafter``).
Their served clusters are all started before the runs and run side by side in one Ray
session, each in its own Ray namespace (:func:`benchmarks.harness.options.namespace_for`).

The prompts are the bundled demo prompts, a JSONL file, or the bundled workload set
(``--prompts workloads``: chat, code-edit, extraction, multi-turn); every table is also split
by the prompts' category. A prompt's ``prediction`` goes out as OpenAI's Predicted Outputs on
the served kappa > 0 requests (``--predictions``; a server that refuses it stops the bench
before its passes), and each served pass begins by clearing its cluster's drafters'
cross-request memory through the gateway, so no request is drafted from an earlier pass's
output of its own prompt (a gateway without that endpoint is noted in the report, loudly).

Modules: options (the command's options and the compared methods), systems (served,
in-process, Hugging Face), llama_server (the llama.cpp peer), report (counter and profile
deltas, the summary), latency (TTFT and inter-token latency percentiles), render (markdown,
plot), method_table (the per-method table and the forward-cost ratio of ``--profile``); the
prompts come from specmesh.data.prompts.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace

from specmesh.benchmarks.harness.llama_server import LlamaServers, find_llama_server, llama_configs
from specmesh.benchmarks.harness.options import (
    BenchDrafter,
    BenchOptions,
    cluster_drafter,
    namespace_for,
    with_drafter,
)
from specmesh.benchmarks.harness.method_table import method_table
from specmesh.benchmarks.harness.render import markdown, write_plot
from specmesh.benchmarks.harness.report import (
    System,
    mismatch_lines,
    mixed_adapter_prompts,
    request_adapters,
    run_notes,
    summarize,
    sweep_systems,
    systems_for,
)
from specmesh.benchmarks.harness.systems import (
    InProcessSystems,
    KappaSampler,
    check_predictions,
    generation_eos_ids,
    load_hf_model,
    run_hf,
    run_served,
    served_drafter_costs,
)
from specmesh.cluster.config import ClusterConfig, default_threads
from specmesh.cluster.options import is_model_drafter
from specmesh.cluster.runs import RunResult, load_prompts, openai_client, run_openai
from specmesh.data.prompts import level_requests, load_prompt_set
from specmesh.engine.lora_modules import parse_lora_modules
from specmesh.gateway.tokens import chat_prompt_ids

def bench_prompts(opts: BenchOptions) -> list[dict]:
    """The prompts of the run: the user's file, the bundled workload set (``--prompts
    workloads``) or the bundled demo prompts, the first ``num_prompts`` of them."""
    prompts = load_prompt_set(opts.prompts_file) if opts.prompts_file else load_prompts()
    return prompts[:opts.num_prompts] if opts.num_prompts else prompts


def _schedule(levels: list[int], kappa: int, repeats: int,
              methods: Sequence[str] = ("ngram",),
              served_only: Sequence[str] = (), baselines: Sequence[str] = ("hf",),
              llama_spec_type: str | None = None,
              only_served: bool = False) -> list[tuple[int, int, System]]:
    """(repeat, level, system) in run order: each repeat runs every level and system (each
    method's kappa > 0 systems and the baselines' among them; the served ones only with
    ``only_served``), the order of levels and of systems rotated per repeat."""
    out = []
    for r in range(repeats):
        lv = levels[r % len(levels):] + levels[:r % len(levels)]
        for level in lv:
            systems = level_systems_for(kappa, level, methods, served_only, baselines,
                                        llama_spec_type, only_served)
            k = r % len(systems)
            out += [(r, level, s) for s in systems[k:] + systems[:k]]
    return out


def level_systems_for(kappa: int, level: int, methods: Sequence[str],
                      served_only: Sequence[str], baselines: Sequence[str],
                      llama_spec_type: str | None, only_served: bool) -> list[System]:
    """:func:`report.systems_for`, the served systems only with ``only_served`` (a
    mixed-adapter load: in-process and the baselines serve no LoRA adapters)."""
    systems = systems_for(kappa, level, methods, served_only, baselines, llama_spec_type)
    return [s for s in systems if s.kind == "served"] if only_served else systems


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


def _interrupt(signum: int, frame) -> None:  # noqa: ANN001
    signal.signal(signum, signal.SIG_IGN)  # once: a second one must not cut the cleanup short
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Within: the first SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so the ``finally``
    blocks stop the clusters and llama-servers the bench started (Ray's own handler,
    installed when the first cluster starts, would end the process at once); later ones are
    ignored until the block ends, so they cannot interrupt that cleanup (SIGKILL still ends
    it). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def bench_process_threads(cfg: ClusterConfig) -> int:
    """Torch threads of the bench process, where the in-process systems and Hugging Face run:
    every core (the plain verifier's share, as a user's own ``generate`` would have), or the
    most a role has when the user set the plan (``--threads`` / ``--thread-plan``). A model
    drafter's default plan, which leaves its served verifier one core fewer, does not count
    as set: the baselines keep every core."""
    if cfg.threads == default_threads(model_drafter=is_model_drafter(cfg.drafter.method)):
        return default_threads()["verifier"]
    return max(cfg.threads.values())


def llama_peer(opts: BenchOptions, model: str | None) -> tuple[str, str, str] | str:
    """(binary, how it was found, GGUF path) of the llama-server baseline, or why it is
    skipped (no binary, or a model that is not a GGUF)."""
    from specmesh.engine.loader import model_gguf  # the engine: torch and triton kernels

    binary, how = find_llama_server(opts.llama_server)
    if binary is None:
        return how
    gguf = model_gguf(model)
    if gguf is None:
        return f"the model {model!r} is not a GGUF (llama-server runs GGUF files)"
    return binary, how, str(gguf)


def start_llama(llama: LlamaServers, model: str, prompts: list[dict],
                num_prompt_tokens: int) -> bool:
    """Start the llama-servers and warm each up with every prompt (as the served clusters
    are: report.WARMUP_NOTE); returns whether they count the ``num_prompt_tokens``
    specmesh's tokenizer does for the first (the same chat template), printing a warning
    when not."""
    print(f"[bench] starting llama-server ({', '.join(llama.configs)})", file=sys.stderr,
          flush=True)
    llama.start_all()
    counted = {n: llama.warm_up(n, model, prompts[0]["messages"]) for n in llama.configs}
    for n in llama.configs:
        for p in prompts[1:]:
            llama.warm_up(n, model, p["messages"])
    same = all(n == num_prompt_tokens for n in counted.values())
    if not same:
        print(f"[bench] llama-server counts {counted} prompt tokens for the first prompt, "
              f"specmesh {num_prompt_tokens}: the chat templates differ", file=sys.stderr,
              flush=True)
    return same


def bench(cfg: ClusterConfig, opts: BenchOptions, handle=None) -> dict:
    """Run the bench on ``cfg`` for the methods of ``opts.drafters`` (default: ``cfg``'s),
    starting a served cluster per method (``handle``, a running
    :class:`cluster.launcher.ClusterHandle`, serves its own method when listed, and is left
    running with its kappa restored) and, with the ``llama-server`` baseline, a llama-server
    plain and one with speculation (stopped at the end, on error too; skipped with a note
    when there is no binary). Returns the summary
    (:func:`benchmarks.harness.report.summarize`); ``summary["mismatches"]`` lists every
    specmesh system whose output differed from kappa = 0."""
    # torch, transformers and the engine load when a bench runs, not for --help
    import torch
    from tqdm import tqdm

    from specmesh.engine.backend import cpu_backend
    from specmesh.engine.devices import resolve_device
    from specmesh.engine.loader import load_model, load_tokenizer, model_name

    if opts.sweep:
        return sweep(cfg, opts)
    prompts = bench_prompts(opts)
    # a mixed-adapter load (--lora-modules): every prompt on the base and on each adapter,
    # served systems only (in-process and the baselines serve no adapters)
    adapter_names = sorted(parse_lora_modules(cfg.lora_modules))
    served_prompts = mixed_adapter_prompts(prompts, adapter_names)
    kappa = cfg.verifier.num_speculative_tokens
    drafters = list(opts.drafters or [cluster_drafter(cfg)])
    labels = [d.label for d in drafters]
    served_only = [d.label for d in drafters if d.served_only]
    inproc_labels = [label for label in labels if label not in served_only]
    baselines = tuple(opts.baselines) if not adapter_names else ()
    llama_info: dict = {}
    if "llama-server" in baselines:
        peer = llama_peer(opts, cfg.model)
        if isinstance(peer, str):
            print(f"[bench] llama-server skipped: {peer}", file=sys.stderr, flush=True)
            baselines = tuple(b for b in baselines if b != "llama-server")
            llama_info = {"skipped": peer}
    model = model_name(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    # each served cluster's plan (a method's default plan unless the user set one)
    plans = {d.label: with_drafter(cfg, d).threads for d in drafters}
    bench_threads = bench_process_threads(cfg)
    torch.set_num_threads(bench_threads)  # HF and in-process run here
    hf_model = load_hf_model(cfg.model, cfg.dtype) if "hf" in baselines else None
    eos = generation_eos_ids(hf_model) if hf_model is not None else []
    loaded = load_model(cfg.model, dtype=cfg.dtype, device=resolve_device(cfg.device),
                        backend=cpu_backend(cfg.backend))  # the served roles' choices
    prompt_ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts]
    level_systems = {c: level_systems_for(kappa, c, labels, served_only, baselines,
                                          opts.llama_spec_type, bool(adapter_names))
                     for c in opts.concurrency}
    llama = None
    if "llama-server" in baselines:
        binary, how, gguf = peer
        llama = LlamaServers(llama_configs(
            binary, gguf, plans[labels[0]]["verifier"], opts.concurrency,
            max(len(p) for p in prompt_ids), opts.max_tokens, kappa,
            level_systems[max(opts.concurrency)], opts.llama_server_args))
        llama_info = {"binary": binary, "found": how,
                      "servers": {n: c.as_dict() for n, c in llama.configs.items()},
                      "spec_state": "kept across passes" if opts.llama_keep_spec_state
                      else "a fresh speculative server per pass"}
    synthetic = cfg.verifier.synthetic_acceptance  # the ablation harness (decode/synthetic.py)
    inproc = InProcessSystems(loaded, max(len(p) for p in prompt_ids), opts.max_tokens,
                              methods={d.label: with_drafter(cfg, d) for d in drafters
                                       if not d.served_only},
                              verifier_options={"verify_rule": cfg.verifier.verify_rule,
                                                "synthetic_acceptance": synthetic,
                                                "goodput_drafts": cfg.verifier.goodput_drafts,
                                                "speculative_policy":
                                                    cfg.verifier.speculative_policy,
                                                "speculative_schedule":
                                                    cfg.verifier.speculative_schedule},
                              kv_cache_dtype=cfg.kv_cache_dtype)
    forward_cost: dict[str, dict] = {}  # per concurrency: its batch's forward cost ratio
    if opts.profile and kappa > 0:
        # torch and the model runner, only with --profile
        from specmesh.benchmarks.harness.method_table import forward_cost_ratio

        ctx = min(200, loaded.config.max_position_embeddings - kappa - 1)
        for level in opts.concurrency:
            forward_cost[str(level)] = forward_cost_ratio(
                loaded.model, loaded.config, kappa, context_len=ctx, batch=level,
                repeats=15 if level <= 4 else 7, kv_cache_dtype=cfg.kv_cache_dtype).as_dict()
    # in-process warm-up first: each method's proposer is built here, so a missing head or
    # draft model fails before any cluster starts
    if not adapter_names:
        for label in inproc_labels:
            inproc.run(prompt_ids[:1], kappa, 1, "warmup", label)
        inproc.run(prompt_ids[:1], 0, 1, "warmup")
    handles, started = _start_served(cfg, drafters, handle)
    served_note = (f"one cluster per draft method ({', '.join(labels)}), all started before "
                   f"the runs and running side by side in one Ray session, each in its own "
                   f"Ray namespace; served k=0 runs on the {labels[0]} cluster")
    runs: dict[int, dict[str, list[RunResult]]] = {c: {} for c in opts.concurrency}
    cleared: dict[str, list[bool]] = {}  # served cluster -> per pass: its history cleared
    with sigterm_unwinds():  # after the clusters started: Ray's handler replaced
        try:
            clients = {label: openai_client(h.url, h.api_key) for label, h in handles.items()}
            for label in labels:
                handles[label].set_num_speculative_tokens(kappa)
                run_openai(clients[label], model, prompts, 4, "warmup")  # report.WARMUP_NOTE
                if opts.predictions and kappa > 0:  # a server refusing them fails here
                    check_predictions(clients[label], model, prompts)
            if hf_model is not None:
                run_hf(hf_model, tokenizer, prompts[:1], 4, "warmup", eos)
            if llama is not None:
                llama_info["prompt_tokens_match"] = start_llama(llama, model, prompts,
                                                                len(prompt_ids[0]))
            schedule = _schedule(opts.concurrency, kappa, opts.repeats, labels, served_only,
                                 baselines, opts.llama_spec_type, bool(adapter_names))
            bar = tqdm(schedule, desc="bench", unit="run", disable=not opts.progress,
                       file=sys.stderr)
            for r, level, system in bar:
                bar.set_postfix_str(f"C={level} {system.name}")
                reqs = level_requests(prompts, level)
                if system.kind == "served":
                    label = system.method or labels[0]  # kappa = 0: the first method's cluster
                    # the cluster's drafters' history cleared first (see run_served)
                    res = run_served(handles[label], clients[label], model,
                                     level_requests(served_prompts, level), opts.max_tokens,
                                     system.kappa, level, system.name,
                                     predictions=opts.predictions)
                    cleared.setdefault(label, []).append(bool(res.history_cleared))
                elif system.kind == "inprocess":
                    ids = level_requests(prompt_ids, level)
                    res = inproc.run(ids, system.kappa, level, system.name, system.method)
                elif system.kind == "llama":
                    if system.kappa > 0 and not opts.llama_keep_spec_state:
                        llama.restart(system.name, model)  # no n-gram memory of earlier passes
                    res = llama.run(system.name, model, reqs, opts.max_tokens, level)
                else:
                    res = run_hf(hf_model, tokenizer, reqs, opts.max_tokens, system.name, eos,
                                 batch_size=1 if system.kappa else level,
                                 prompt_lookup=system.kappa or None)
                runs[level].setdefault(system.name, []).append(res)
                tqdm.write(f"[bench] repeat {r + 1}/{opts.repeats} C={level} {system.name}: "
                           f"{res.num_tokens} tokens in {res.seconds:.2f} s, "
                           f"{res.tokens_per_s:.2f} tok/s", file=sys.stderr)
            bar.close()
            # each method's weights, draft KV and forward count (the per-method table)
            costs = {label: served_drafter_costs(handles[label]) for label in labels}
        finally:
            if llama is not None:
                llama.stop_all()
            for h in handles.values():
                h.set_num_speculative_tokens(kappa)
            for h in started:
                h.stop()
    sent = opts.predictions and kappa > 0  # predictions go with kappa > 0 requests only
    config = {"model": model, "dtype": cfg.dtype, "kv_cache_dtype": cfg.kv_cache_dtype,
              "kappa": kappa, "max_tokens": opts.max_tokens,
              "num_prompts": len(prompts), "prompt_names": [p["name"] for p in prompts],
              "repeats": opts.repeats, "concurrency": opts.concurrency, "threads": plans[labels[0]],
              "cluster_threads": plans,
              "bench_threads": bench_threads, "drafters": [d.as_dict() for d in drafters],
              "draft_method": drafters[0].method, "served_clusters": served_note,
              "profile": opts.profile, "verify_rule": cfg.verifier.verify_rule,
              "synthetic_acceptance": list(synthetic), "baselines": list(baselines),
              "llama_server": llama_info or None, "prompts": opts.prompts_file or "demo",
              "predictions": {"sent": sent, "num_prompts_with_prediction": sum(
                  1 for p in prompts if p.get("prediction"))},
              "drafter_history_cleared": cleared, "lora_modules": adapter_names,
              "notes": run_notes(prompts, opts.concurrency, cleared, sent)
              + adapter_notes(adapter_names, len(prompts))}
    categories = {c: [p["category"] for p in level_requests(served_prompts, c)]
                  for c in opts.concurrency}
    adapters = {c: request_adapters(level_requests(served_prompts, c))
                for c in opts.concurrency} if adapter_names else None
    summary = summarize(config, runs, level_systems, forward_cost or None, categories,
                        adapters)
    summary["drafter_costs"] = costs
    summary["per_method"] = method_table(summary) if kappa > 0 else None
    write_outputs(summary, opts)
    return summary


def adapter_notes(adapters: Sequence[str], num_prompts: int) -> list[str]:
    """The header line of a mixed-adapter load (none without adapters)."""
    if not adapters:
        return []
    return [f"mixed-adapter load (--lora-modules {', '.join(adapters)}): every served pass "
            f"sends each of the {num_prompts} prompts on the base model and on each adapter "
            f"({num_prompts * (len(adapters) + 1)} requests, mixed in one batch); drafters "
            f"draft from the base model, so an adapter that changes the output costs "
            f"acceptance, never correctness (k=K still equals k=0 per request); served "
            f"systems only (in-process, HF and llama-server serve no adapters)"]


# -- the adaptive-speculation sweep (--kappas / --policy) ----------------------------------


def sweep_config(cfg: ClusterConfig, d: BenchDrafter, policy: str, kappa: int,
                 namespace: str) -> ClusterConfig:
    """The served cluster of method ``d`` under ``--speculative-policy policy`` with kappa
    ``kappa`` (the fixed passes set theirs per pass; a policy adapts within it), in
    ``namespace``; the drafter's windows derived again from its kappa."""
    out = with_drafter(cfg, d, namespace)
    verifier = replace(out.verifier, speculative_policy=policy, num_speculative_tokens=kappa,
                       speculative_schedule=out.verifier.speculative_schedule
                       if policy == "schedule" else None)
    return replace(out, verifier=verifier,
                   drafter=replace(out.drafter, window=0, max_segment=0, prediction_window=0))


def _sweep_schedule(levels: list[int], systems: list[System], repeats: int
                    ) -> list[tuple[int, int, System]]:
    """(repeat, level, system) in run order: every repeat runs every level and system, the
    order of levels and of systems rotated per repeat (as :func:`_schedule`)."""
    out = []
    for r in range(repeats):
        lv = levels[r % len(levels):] + levels[:r % len(levels)]
        for level in lv:
            k = r % len(systems)
            out += [(r, level, s) for s in systems[k:] + systems[:k]]
    return out


def _cost_tables(handles: dict) -> dict[str, dict | None]:
    """Per served cluster (``"method (policy)"``), its first verifier's verify cost table as
    its ``stats()`` show it (None: the cluster's policy runs without one)."""
    import ray  # ray: the served clusters are running

    out = {}
    for (label, policy), h in handles.items():
        stats = ray.get([a.stats.remote() for a in h.verifiers()])
        out[f"{label} ({policy})"] = stats[0].get("verify_cost_table") if stats else None
    return out


def _confidence_calibration(handles: dict) -> dict[str, dict]:
    """Per served cluster under the confidence policy (``"method (confidence)"``), its first
    verifier's predicted vs realised accepted drafts and reliability bins over its life
    (decode/confidence_budget.py ConfidenceStats, as its ``stats()`` show them)."""
    import ray  # ray: the served clusters are running

    out = {}
    for (label, policy), h in handles.items():
        if policy != "confidence":
            continue
        stats = ray.get([a.stats.remote() for a in h.verifiers()])
        out[f"{label} ({policy})"] = stats[0].get("confidence_budget") if stats else None
    return out


def sweep(cfg: ClusterConfig, opts: BenchOptions) -> dict:
    """The adaptive-speculation sweep: per draft method one served cluster under
    ``--speculative-policy fixed`` (every ``opts.kappas`` pass, set per pass; k = 0 once, on
    the first method's) and one per adaptive policy of ``opts.policies`` (kappa: the largest
    fixed one), all started before the runs, each pass's kappa sampled through it
    (:class:`systems.KappaSampler`); repeats, levels and systems interleaved. Served systems
    only (no in-process, HF or llama-server passes). Returns the summary: the plain bench's
    (output identity against k = 0, ``mismatches``), each policy system's ``kappa_timeline``
    per repeat and each level's ``policy_vs_best_fixed``
    (:func:`report.policy_vs_best_fixed`); with the confidence policy,
    ``confidence_calibration``: per such cluster its predicted vs realised accepted drafts
    (mean error per step) and reliability bins."""
    # the engine's tokenizer loader: transformers, only when a bench runs
    from tqdm import tqdm

    from specmesh.cluster.launcher import start_cluster
    from specmesh.engine.loader import model_name

    prompts = bench_prompts(opts)
    kappas, policies = list(opts.kappas or [0, cfg.verifier.num_speculative_tokens]), \
        tuple(opts.policies)
    top = max(kappas)
    drafters = list(opts.drafters or [cluster_drafter(cfg)])
    labels = [d.label for d in drafters]
    systems = sweep_systems(kappas, policies, labels)
    model = model_name(cfg.model)
    clusters = {(d.label, p): sweep_config(cfg, d, p, top, f"{namespace_for(d, i)}-{p}")
                for i, d in enumerate(drafters) for p in ("fixed", *policies)
                if top > 0 or p == "fixed"}
    handles: dict = {}
    runs: dict[int, dict[str, list[RunResult]]] = {c: {} for c in opts.concurrency}
    cleared: dict[str, list[bool]] = {}
    with sigterm_unwinds():
        try:
            for (label, policy), c in clusters.items():
                print(f"[bench] starting the served cluster of {label} under policy {policy} "
                      f"(namespace {c.namespace})", file=sys.stderr, flush=True)
                handles[(label, policy)] = start_cluster(c, num_clusters=len(clusters))
            clients = {key: openai_client(h.url, h.api_key) for key, h in handles.items()}
            for key, h in handles.items():
                h.set_num_speculative_tokens(top)
                run_openai(clients[key], model, prompts, 4, "warmup")  # report.WARMUP_NOTE
            schedule = _sweep_schedule(opts.concurrency, systems, opts.repeats)
            bar = tqdm(schedule, desc="sweep", unit="run", disable=not opts.progress,
                       file=sys.stderr)
            for r, level, system in bar:
                bar.set_postfix_str(f"C={level} {system.name}")
                key = (system.method or labels[0], system.policy or "fixed")
                with KappaSampler(handles[key]) as sampler:
                    res = run_served(handles[key], clients[key], model,
                                     level_requests(prompts, level), opts.max_tokens,
                                     system.kappa, level, system.name,
                                     predictions=opts.predictions)
                res.kappa_timeline = sampler.timeline
                cleared.setdefault(f"{key[0]} ({key[1]})", []).append(bool(res.history_cleared))
                runs[level].setdefault(system.name, []).append(res)
                tqdm.write(f"[bench] repeat {r + 1}/{opts.repeats} C={level} {system.name}: "
                           f"{res.num_tokens} tokens in {res.seconds:.2f} s, "
                           f"{res.tokens_per_s:.2f} tok/s", file=sys.stderr)
            bar.close()
            tables = _cost_tables(handles)
            calibration = _confidence_calibration(handles)
        finally:
            for h in handles.values():
                h.stop()
    sent = opts.predictions and top > 0
    config = {"model": model, "dtype": cfg.dtype, "kv_cache_dtype": cfg.kv_cache_dtype,
              "kappa": top, "kappas": kappas, "policies": list(policies),
              "verify_cost_table": cfg.verifier.verify_cost_table or "off",
              "verify_cost_tables": tables,
              "max_tokens": opts.max_tokens, "num_prompts": len(prompts),
              "prompt_names": [p["name"] for p in prompts], "repeats": opts.repeats,
              "concurrency": opts.concurrency, "drafters": [d.as_dict() for d in drafters],
              "draft_method": drafters[0].method, "threads": clusters[
                  (labels[0], "fixed")].threads, "baselines": [],
              "served_clusters": f"per draft method one cluster under --speculative-policy "
                                 f"fixed (k = {', '.join(map(str, kappas))}, set per pass) and "
                                 f"one per policy ({', '.join(policies) or 'none'}; kappa "
                                 f"{top}), side by side in one Ray session",
              "drafter_history_cleared": cleared,
              "notes": run_notes(prompts, opts.concurrency, cleared, sent)}
    categories = {c: [p["category"] for p in level_requests(prompts, c)]
                  for c in opts.concurrency}
    summary = summarize(config, runs, {c: systems for c in opts.concurrency}, None, categories)
    summary["sweep"] = {"kappas": kappas, "policies": list(policies)}
    if calibration:  # --policy confidence: predicted vs realised accepted drafts
        summary["confidence_calibration"] = calibration
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
