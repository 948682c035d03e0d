"""How ``specmesh bench`` shows a summary (benchmarks/harness/report.py): markdown tables with the
thread plan, step profiles and forward-cost check, and a PNG plot (matplotlib, Agg). Pure
functions over the summary dict."""

from __future__ import annotations

from specmesh.benchmarks.harness.method_table import method_table_markdown
from specmesh.benchmarks.harness.report import mismatch_lines


def _frac(flags: list[bool] | None) -> str:
    return "" if flags is None else f"{sum(flags)}/{len(flags)}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "" if x is None else format(x, fmt)


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} ms"


def thread_plan_text(cfg: dict) -> str:
    """The thread plan of a run's config: torch threads per served role and of the bench
    process (in-process systems and HF)."""
    def roles(plan: dict) -> str:
        return ", ".join(f"{r} {n}" for r, n in plan.items())

    plans = cfg.get("cluster_threads") or {}
    if len({tuple(p.items()) for p in plans.values()}) > 1:  # methods with plans of their own
        text = "served roles: " + "; ".join(f"{label}: {roles(p)}" for label, p in plans.items())
    else:
        text = f"served roles: {roles(cfg.get('threads') or {}) or 'n/a'}"
    if cfg.get("bench_threads") is not None:
        text += f"; bench process (in-process, HF): {cfg['bench_threads']}"
    return text


def _per_pos(acc: list[float]) -> str:
    return " / ".join(f"{a:.2f}" for a in acc)


def _identical_k0(s: dict) -> str:
    text = _frac(s["identical_to_k0"])
    return f"**{text} MISMATCH**" if s.get("exact") is False else text


def _p50_p95(latency: dict | None, key: str) -> str:
    """``p50 / p95`` of a system's ``latency[key]`` in ms (empty when not streamed)."""
    q = (latency or {}).get(key) or {}
    if q.get("p50") is None:
        return ""
    return f"{q['p50']:.1f} / {q['p95']:.1f}"


def llama_server_text(info: dict | None) -> str | None:
    """The header line of the llama-server baseline: its binary, threads, slots, context and
    speculation (or why it was skipped); None when it was not asked for."""
    if not info:
        return None
    if "skipped" in info:
        return f"llama-server: skipped ({info['skipped']})"
    servers = list(info.get("servers", {}).values())
    if not servers:
        return None
    c = servers[0]
    specs = [s["spec_type"] for s in servers if s.get("spec_type")]
    text = (f"llama-server: {info['binary']}, -t {c['threads']}, --parallel {c['parallel']}, "
            f"-c {c['ctx_size']}, the same GGUF, no prompt cache")
    if specs:
        text += f"; speculation {', '.join(specs)} with at most kappa drafts"
        if info.get("spec_state"):
            text += f" ({info['spec_state']})"
    if c.get("extra_args"):
        text += f"; extra options {' '.join(c['extra_args'])}"
    text += ("; llama.cpp computes on the Q4_1 blocks its own way, so its identity columns "
             "are for information")
    if info.get("prompt_tokens_match") is False:
        text += "; **its chat template renders the prompts differently**"
    return text


def markdown(summary: dict) -> str:
    """A header (model, dtype, kappa, draft methods, thread plan, how the served clusters ran,
    and a loud line per output mismatch), the per-method table when the summary has one
    (benchmarks/harness/method_table.py), then a table per concurrency level: system, tokens/s
    (median), ratio to HF, acceptance rate, mean accept length, acceptance per draft
    position, share of verify steps with drafts, accepted drafts per verify step (all
    steps), identical outputs (vs HF; kappa=K vs kappa=0), TTFT and inter-token latency
    p50 / p95 of the streamed systems, then the level's ratios (served vs llama-server among
    them) and Predicted Outputs tokens, the table by prompt category
    (:func:`category_markdown`), the table by LoRA adapter of a mixed-adapter load
    (:func:`adapter_markdown`); the step profiles and the step-cost check when the summary
    has them. The config's ``notes`` are header lines."""
    cfg = summary["config"]
    drafters = ", ".join(d["label"] for d in cfg.get("drafters", [])) or cfg.get(
        "draft_method", "")
    lines = [f"# specmesh bench: {cfg['model']} ({cfg['dtype']}), kappa={cfg['kappa']}"
             + (f", drafters {drafters}" if drafters else "")
             + f", max_tokens={cfg['max_tokens']}, {cfg['num_prompts']} prompts, "
             f"{cfg['repeats']} repeat(s)", "", f"- thread plan: {thread_plan_text(cfg)}"]
    if cfg.get("served_clusters"):
        lines.append(f"- served clusters: {cfg['served_clusters']}")
    if cfg.get("kv_cache_dtype", "auto") != "auto":
        lines.append(f"- KV cache: {cfg['kv_cache_dtype']} (--kv-cache-dtype): outputs may "
                     f"differ from HF {cfg['dtype']}; k=K still equals k=0")
    peer = llama_server_text(cfg.get("llama_server"))
    if peer:
        lines.append(f"- {peer}")
    if any(s.get("latency") for lv in summary["levels"].values()
           for s in lv["systems"].values()):
        lines.append("- TTFT: request sent to first content chunk; ITL: per request, (last "
                     "token - first token) / (tokens - 1); p50 / p95 over the level's "
                     "streamed requests, all repeats, ms")
    lines += [f"- {note}" for note in cfg.get("notes") or []]
    if cfg.get("synthetic_acceptance"):
        curve = ", ".join(f"{a:.3f}" for a in cfg["synthetic_acceptance"])
        lines.append(f"- **SYNTHETIC ACCEPTANCE** (ablation, --verify-rule synthetic): drafts "
                     f"accepted along [{curve}] per position, not verified; outputs are not "
                     f"the target's")
    lines.append("")
    loud = mismatch_lines(summary)
    if loud:
        lines += [f"**{m}**" for m in loud] + [""]
    lines += sweep_markdown(summary)
    lines += calibration_markdown(summary)
    lines += method_table_markdown(summary)  # the per-method table (method_table.py)
    for level in summary["levels"].values():
        lines += [f"## concurrency {level['concurrency']} ({level['num_requests']} requests)",
                  "", "| system | tokens/s | x HF | acceptance | mean accept len | "
                  "acceptance per position | steps with drafts | accepted per step | "
                  "identical to HF | identical k=K vs k=0 | TTFT p50 / p95 ms | "
                  "ITL p50 / p95 ms |", "|---" * 12 + "|"]
        for name, s in level["systems"].items():
            spec = s["kappa"] > 0 and s["kind"] != "hf"  # HF reports no spec stats
            steps = spec and s["kind"] != "llama"  # llama.cpp reports no verify steps
            lines.append(
                f"| {name} | {s['median_tokens_per_s']:.2f} | {_num(s['ratio_to_hf'])} | "
                f"{_num(s['acceptance_rate']) if spec else ''} | "
                f"{_num(s['mean_accept_len']) if steps else ''} | "
                f"{_per_pos(s.get('acceptance_per_position') or []) if spec else ''} | "
                f"{_num(s.get('verify_steps_with_drafts_share'), '.0%') if spec else ''} | "
                f"{_num(s.get('accepted_per_step')) if spec else ''} | "
                f"{_frac(s['identical_to_hf'])} | {_identical_k0(s)} | "
                f"{_p50_p95(s.get('latency'), 'ttft_ms')} | "
                f"{_p50_p95(s.get('latency'), 'itl_ms')} |")
        lines.append("")
        lines += [f"- {k}: {v:.2f}x" for k, v in level["ratios"].items()]
        lines += [f"- prediction tokens accepted / rejected, {name}: "
                  f"{p['accepted']} / {p['rejected']} ({p['num_requests']} responses)"
                  for name, s in level["systems"].items() if (p := s.get("prediction_tokens"))]
        lines.append("")
        lines += category_markdown(level)
        lines += adapter_markdown(level)
        lines += profile_markdown(level)
    costs = summary.get("forward_cost_by_level") or (
        {"1": summary["forward_cost"]} if summary.get("forward_cost") else {})
    for fc in costs.values():
        lines += [f"forward cost, batch {fc.get('batch', 1)} ({fc['num_tokens']}-token / "
                  f"1-token forward per request after {fc['context_len']} tokens): "
                  f"{fc['multi_ms']:.2f} / {fc['single_ms']:.2f} ms = {fc['ratio']:.2f}x", ""]
    return "\n".join(lines)


def _prediction_cell(p: dict | None) -> str:
    return "" if p is None else f"{p['accepted']} / {p['rejected']}"


def category_markdown(level: dict) -> list[str]:
    """The level's systems split by prompt category (when its requests span two or more):
    a row per category and system with its requests, tokens/s per client and its ratio to the
    kappa = 0 counterpart's, acceptance, mean accept length, identical outputs k=K vs k=0 and,
    when any request reported them, accepted / rejected prediction tokens."""
    cats = level.get("categories") or []
    if len(cats) < 2:
        return []
    systems = level["systems"]
    preds = any(row.get("prediction_tokens") for s in systems.values()
                for row in (s.get("categories") or {}).values())
    lines = [f"### by category, concurrency {level['concurrency']} (tokens/s per client: the "
             f"category's completion tokens / the sum of its requests' times, the pass's "
             f"throughput split by category at concurrency 1; blank where a system has no "
             f"per-request times)", "",
             "| category | system | requests | tokens/s per client | x k=0 | acceptance | "
             "mean accept len | identical k=K vs k=0 |"
             + (" prediction tokens accepted / rejected |" if preds else ""),
             "|---" * (9 if preds else 8) + "|"]
    for cat in cats:
        for name, s in systems.items():
            row = (s.get("categories") or {}).get(cat)
            if row is None:
                continue
            spec = s["kappa"] > 0 and s["kind"] != "hf"
            steps = spec and s["kind"] != "llama"
            same = _frac(row["identical_to_k0"])
            if row.get("exact") is False:
                same = f"**{same} MISMATCH**"
            lines.append(
                f"| {cat} | {name} | {row['num_requests']} | "
                f"{_num(row['median_tokens_per_s'])} | {_num(row.get('ratio_to_k0'))} | "
                f"{_num(row['acceptance_rate']) if spec else ''} | "
                f"{_num(row['mean_accept_len']) if steps else ''} | {same} |"
                + (f" {_prediction_cell(row.get('prediction_tokens'))} |" if preds else ""))
    lines.append("")
    return lines


def adapter_markdown(level: dict) -> list[str]:
    """The level's served systems split by LoRA adapter (a mixed-adapter load, ``specmesh
    bench --lora-modules``): a row per adapter (the base model first) and system with its
    requests, tokens/s per client and its ratio to kappa = 0, acceptance rate and its ratio to
    the base model's, accepted drafts per verify step with drafts, identical outputs k=K vs
    k=0. Empty without adapters."""
    names = level.get("adapters") or []
    if not names:
        return []
    lines = [f"### by LoRA adapter, concurrency {level['concurrency']} (served; every prompt "
             f"on the base and on each adapter; drafters draft from the base; tokens/s per "
             f"client: the adapter's completion tokens / the sum of its requests' times)", "",
             "| adapter | system | requests | tokens/s per client | x k=0 | acceptance | "
             "x base acceptance | accepted per step | identical k=K vs k=0 |", "|---" * 9 + "|"]
    for name in names:
        for sys_name, s in level["systems"].items():
            row = (s.get("adapters") or {}).get(name)
            if row is None:
                continue
            spec = s["kappa"] > 0
            same = _frac(row["identical_to_k0"])
            if row.get("exact") is False:
                same = f"**{same} MISMATCH**"
            lines.append(
                f"| {name} | {sys_name} | {row['num_requests']} | "
                f"{_num(row['median_tokens_per_s'])} | {_num(row.get('ratio_to_k0'))} | "
                f"{_num(row['acceptance_rate']) if spec else ''} | "
                f"{_num(row.get('acceptance_vs_base')) if spec else ''} | "
                f"{_num(row['mean_accept_len']) if spec else ''} | {same} |")
    lines.append("")
    return lines


def profile_markdown(level: dict) -> list[str]:
    """The verifier step profile of the level's kappa > 0 systems that have one: a row per
    phase (p50 / mean ms), the share of verify steps with a usable tail, and the check of
    the mean verify forward with drafts against 1.1 x forward-cost ratio x without drafts."""
    profiled = {n: s for n, s in level["systems"].items() if s.get("profile")}
    if not profiled:
        return []
    names = list(profiled)
    phases: list[str] = []
    for s in profiled.values():
        phases += [p for p in s["profile"]["phases"] if p not in phases]
    lines = [f"### verifier step profile, concurrency {level['concurrency']} (p50 / mean ms; "
             "rows named `drafter …` are the drafter's phases)",
             "", "| phase | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for p in phases:
        cells = []
        for n in names:
            ph = profiled[n]["profile"]["phases"].get(p)
            cells.append(f"{ph['p50_ms']:.2f} / {ph['mean_ms']:.2f} (n={ph['count']})"
                         if ph else "")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    for key, label in (("steps_with_tail_share", "steps with a usable tail (supply)"),
                       ("steps_with_drafts_share", "steps that verified drafts (after caps)"),
                       ("request_steps_with_tail_share", "request-steps with a usable tail"),
                       ("request_steps_with_drafts_share",
                        "request-steps that verified drafts")):
        lines.append(f"| {label} | " + " | ".join(
            _num(profiled[n]["profile"].get(key), ".0%") for n in names) + " |")
    hits = {n: profiled[n]["profile"].get("branch_hit_share") for n in names}
    if any(h is not None for h in hits.values()):
        lines.append("| commits whose next draft was a prepared branch | " + " | ".join(
            _num(hits[n], ".0%") for n in names) + " |")
    for key, label, fmt in (("seed_state_bytes_per_request",
                             "seed-state bytes per request (prefill -> decode)", ".0f"),
                            ("tree_nodes_per_tree", "nodes per draft tree sent", ".1f")):
        vals = {n: profiled[n]["profile"].get(key) for n in names}
        if any(v is not None for v in vals.values()):
            lines.append(f"| {label} | " + " | ".join(_num(vals[n], fmt) for n in names)
                         + " |")
    lines.append("")
    for n in names:
        c = profiled[n].get("step_cost")
        if not c:
            continue
        ok = {True: "within", False: "OVER", None: "n/a"}[c["within_bound"]]
        lines.append(f"- {n}: mean verify forward with drafts {_ms(c['with_drafts_mean_ms'])}, "
                     f"without {_ms(c['without_drafts_mean_ms'])} ({c['without_drafts_from']}); "
                     f"bound {c['tolerance']} x "
                     f"ratio {_num(c['forward_cost_ratio']) or 'n/a'} x without = "
                     f"{_ms(c['bound_ms'])} ({ok})")
    lines.append("")
    return lines


def sweep_markdown(summary: dict) -> list[str]:
    """The adaptive-speculation sweep's table (empty outside a sweep): per policy system, per
    concurrency, its tokens/s over the best fixed kappa's (k = 0 included) with that best
    one named, and the mean drafts per request step it chose over its passes."""
    levels = list(summary["levels"].values())
    names: list[str] = []
    for lv in levels:
        names += [n for n in (lv.get("policy_vs_best_fixed") or {}) if n not in names]
    if not names:
        return []
    lines = ["## policy tokens/s / best fixed", "",
             "| system | " + " | ".join(f"C={lv['concurrency']}" for lv in levels) + " |",
             "|---" * (len(levels) + 1) + "|"]
    for n in names:
        cells = []
        for lv in levels:
            row = (lv.get("policy_vs_best_fixed") or {}).get(n)
            if row is None or row["ratio"] is None:
                cells.append("")
                continue
            drafts = [p["drafts_per_step"] for tl in
                      lv["systems"][n].get("kappa_timeline") or [] for p in tl or []
                      if p["drafts_per_step"] is not None]
            chosen = f", {sum(drafts) / len(drafts):.2f} drafts/step" if drafts else ""
            cells.append(f"{row['ratio']:.2f}x ({row['best_fixed']}{chosen})")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines + [""]


def calibration_markdown(summary: dict) -> list[str]:
    """The confidence policy's calibration (empty without it): per served cluster, the
    accepted drafts its budget predicted and those realised over the steps it decided, the
    mean absolute error per step and the reliability bins' expected calibration error."""
    calib = summary.get("confidence_calibration") or {}
    if not calib:
        return []
    lines = ["## confidence calibration (predicted vs realised accepted drafts)", "",
             "| cluster | steps | predicted | realised | mean abs error / step | ECE | "
             "fallback steps |", "|---|---|---|---|---|---|---|"]
    for name, st in calib.items():
        if not st:
            lines.append(f"| {name} | | | | | | |")
            continue
        lines.append(f"| {name} | {st['num_steps']} | {_num(st['predicted_accepted_drafts'])} "
                     f"| {st['realised_accepted_drafts']} | "
                     f"{_num(st['mean_abs_error_per_step'])} | "
                     f"{_num(st['reliability_ece'], '.3f')} | {st['num_fallback_steps']} |")
    return lines + [""]


def _plot_reliability(ax, calib: dict) -> None:
    """The confidence policy's reliability plot: per cluster, each non-empty bin's mean
    predicted confidence against its realised survival rate (the diagonal: calibrated)."""
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
    for name, st in calib.items():
        rows = [r for r in (st or {}).get("reliability") or [] if r["num_judged"]]
        if rows:
            ax.plot([r["mean_predicted"] for r in rows], [r["survival_rate"] for r in rows],
                    marker="o", label=f"{name} (ECE {_num(st['reliability_ece'], '.3f')})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("predicted survival (confidence used)")
    ax.set_ylabel("realised survival")
    ax.set_title("confidence calibration")
    ax.legend(fontsize=7)


def _plot_kappa(ax, levels: list[dict]) -> None:
    """Drafts per request step (what each policy chose) and the policy's kappa over the first
    repeat of each policy system at each level."""
    for lv in levels:
        for n, s in lv["systems"].items():
            if s.get("policy") in (None, "fixed") or not s.get("kappa_timeline"):
                continue
            tl = s["kappa_timeline"][0] or []
            pts = [(p["t"], p["drafts_per_step"]) for p in tl if p["drafts_per_step"] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".",
                        label=f"{n}, C={lv['concurrency']}")
            if s["policy"] == "schedule" and tl:
                ax.step([p["t"] for p in tl], [p["kappa"] for p in tl], where="post",
                        linestyle="--", label=f"{n} kappa, C={lv['concurrency']}")
    ax.set_xlabel("seconds into the pass (first repeat)")
    ax.set_ylabel("drafts per request step / kappa")
    ax.set_title("chosen kappa over time")
    if ax.lines:
        ax.legend(fontsize=7)


def write_plot(summary: dict, path: str) -> None:
    """A PNG at ``path``: tokens/s vs concurrency per system (left) and acceptance rate per
    draft position of every kappa > 0 specmesh system per level (middle); in the
    adaptive-speculation sweep also the kappa each policy chose over time, and with the
    confidence policy its reliability plot (right). Agg backend."""
    # matplotlib: only with --plot
    import matplotlib

    matplotlib.use("Agg")
    # pyplot after the backend is chosen, and only with --plot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    levels = list(summary["levels"].values())
    sweep = bool(summary.get("sweep"))
    calib = summary.get("confidence_calibration") or {}
    panels = 2 + sweep + bool(calib)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ax1, ax2 = axes[0], axes[1]
    if sweep:
        _plot_kappa(axes[2], levels)
    if calib:
        _plot_reliability(axes[-1], calib)
    names: list[str] = []
    for lv in levels:
        names += [n for n in lv["systems"] if n not in names]
    for n in names:
        pts = [(lv["concurrency"], lv["systems"][n]["median_tokens_per_s"])
               for lv in levels if n in lv["systems"]]
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks([lv["concurrency"] for lv in levels], [str(lv["concurrency"]) for lv in levels])
    ax1.set_xlabel("concurrency (clients / batch size)")
    ax1.set_ylabel("tokens/s (median)")
    ax1.set_title("throughput")
    ax1.legend(fontsize=7)
    for lv in levels:
        for n, s in lv["systems"].items():
            acc = s.get("acceptance_per_position") or []
            if s["kind"] != "hf" and s["kappa"] > 0 and acc:
                ax2.plot(range(1, len(acc) + 1), acc, marker="o",
                         label=f"{n}, C={lv['concurrency']}")
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("accepted / verify steps with drafts")
    ax2.set_ylim(0, 1.05)
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("acceptance per draft position")
    if ax2.lines:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
