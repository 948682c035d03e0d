"""The bench's per-method table (issue 35 item 5, issue 36's must-show): per draft method of
``--drafters`` what one verify step costs and brings, measured in the run, in the JSON
(``summary["per_method"]``) and printed as one markdown table. ``specmesh plan --from-bench``
reads it (cluster/plan_bench.py) for the chain-vs-parallel tie acceptance of this machine.

Each method's served ``kappa = K`` system (its in-process one when it has no served one) at
each concurrency, from the verifier's and the drafter's step profiles over the passes
(benchmarks/harness/report.py: deltas of the counters around each pass, summed over
repeats) and the drafter's stats read once after the runs (``summary["drafter_costs"]``):

- ``forwards_per_step``: the drafter's model forwards (its ``draft_forwards`` counter,
  drafter/draft_memory.py: a batched call over every request counts once; catch-up,
  drafting, tree depths and prepared branches included) / the verifier's steps
  (``num_steps``: batched verify forwards, with drafts or not). A chain pays about kappa, a
  parallel drafter about 1, a method without a model 0; blank when the method does not
  count its forwards;
- ``c = t_draft / t_verify``: the drafter's time in its ``propose`` and ``branches`` phases
  (every call that runs the method; its run-ahead past what was verified included) per
  verifier step, over the verifier's mean ``forward`` phase (the verify forward of a step).
  It is the drafting cost of a step in verify forwards (the chapter's ``kappa * c`` for a
  chain, ``c`` for a parallel drafter); ``c_per_forward`` = c / forwards_per_step is the
  chapter's c, one draft pass over a verify forward (blank without forwards). specmesh's
  drafter runs in its own process ahead of the verifier, so c is what drafting costs, not
  what the verifier waited for (the ``tail_wait`` phase of the step profile says that);
- ``acceptance_per_position``: the share of verify steps (per request, those that carried
  drafts) that accepted at least i drafts, i = 1..kappa (vLLM's per-position acceptance),
  and ``alpha_per_position``: alpha_i, the chance draft i is accepted once the ones before
  it were (:func:`decode.speedup_model.conditional_acceptance`);
- ``accepted_per_step``: accepted drafts per verify step that carried drafts (vLLM's mean
  accept length; a step commits 1 + it tokens: ``tokens_per_step``);
- ``tree_nodes_per_tree``: nodes per draft tree the drafter sent (EAGLE-2, Medusa, n-gram
  trees; None when it drafted chains only);
- ``draft_weights_bytes`` / ``draft_kv_pool_bytes`` (and their sum ``draft_memory_bytes``):
  what the method's proposer reports in the drafter's stats (drafter/draft_memory.py);
- ``seed_state_bytes_per_request``: bytes of the seed state the prefill role shipped per
  request to the decode side (the verifier's ``seed_state_bytes`` / ``num_seed_states``);
- ``tokens_per_s`` per concurrency (median completion tokens / wall second of the served
  passes) and ``speedup_vs_k0``, its ratio to served ``kappa = 0`` at that concurrency.

The per-step figures of the row are those at the smallest concurrency (``reference``); every
concurrency's are under ``levels``. A figure the run did not measure is None (blank in the
table), never 0. Pure functions over the summary dict; no torch, no Ray.

Also here, the measured cost ratio of ``--profile`` (:func:`forward_cost_ratio`): our engine's
forward of ``kappa + 1`` tokens and of one token per request after the same cached context, for
a batch of requests, interleaved, medians and their ratio (a verify step against a plain one on
the machine at hand; at batch 16 that of 80 rows to 16, not of 5 to 1).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from specmesh.decode.speedup_model import conditional_acceptance

#: the drafter's phases that run the method (the bench's profiles prefix them "drafter ")
DRAFT_PHASES = ("drafter propose", "drafter branches")
#: the drafter's forward counter in a bench profile (drafter/worker.py ``draft_forwards``)
FORWARDS_COUNTER = "drafter draft_forwards"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def step_figures(system: dict, costs: dict | None = None) -> dict:
    """The per-step figures of one bench system (a :func:`report.summarize_system` dict with
    its ``profile_raw``) and its drafter's ``costs`` (the drafter's stats: which of
    ``num_draft_forwards`` / ``draft_weights_bytes`` / ``draft_kv_pool_bytes`` it reports;
    None: none): see the module doc. Missing measurements are None."""
    costs = costs or {}
    prof = system.get("profile_raw") or {}
    phases, counters = prof.get("phases") or {}, prof.get("counters") or {}
    steps = counters.get("num_steps") or None
    forward = phases.get("forward") or {}
    t_verify = _ratio(forward.get("total_ms"), forward.get("count"))
    drafted = [phases[p]["total_ms"] for p in DRAFT_PHASES if p in phases]
    t_draft = _ratio(sum(drafted), steps) if drafted else None
    c = _ratio(t_draft, t_verify)
    forwards = (counters.get(FORWARDS_COUNTER, 0) / steps
                if steps and "num_draft_forwards" in costs else None)
    shares = list(system.get("acceptance_per_position") or [])
    spec = system.get("spec_stats") or {}
    accepted = spec.get("mean_accept_len") if spec.get("num_verify_steps") else None
    weights, kv = costs.get("draft_weights_bytes"), costs.get("draft_kv_pool_bytes")
    return {"forwards_per_step": forwards, "draft_ms_per_step": t_draft,
            "verify_forward_ms": t_verify, "num_verify_steps": steps,
            "c": c, "c_per_forward": _ratio(c, forwards),
            "acceptance_per_position": shares,
            "alpha_per_position": conditional_acceptance(shares),
            "accepted_per_step": accepted,
            "tokens_per_step": 1.0 + accepted if accepted is not None else None,
            "draft_weights_bytes": weights, "draft_kv_pool_bytes": kv,
            "draft_memory_bytes": weights + kv if weights is not None and kv is not None
            else None,
            "seed_state_bytes_per_request": _ratio(counters.get("seed_state_bytes"),
                                                   counters.get("num_seed_states")),
            "tree_nodes_per_tree": _ratio(counters.get("drafter tree_nodes"),
                                          counters.get("drafter tree_segments"))}


def _method_systems(level: dict, label: str) -> tuple[str | None, dict | None, dict | None]:
    """(name, system, its kappa = 0 counterpart) of ``label``'s speculative system at one
    level: the served one, else the in-process one; (None, None, None) without either."""
    for kind in ("served", "inprocess"):
        for name, s in level["systems"].items():
            if s.get("kind") == kind and s.get("method") == label and s.get("kappa", 0) > 0:
                plain = next((p for p in level["systems"].values()
                              if p.get("kind") == kind and p.get("kappa", 0) == 0), None)
                return name, s, plain
    return None, None, None


def method_table(summary: dict) -> dict | None:
    """The per-method table of a bench ``summary`` (module doc): ``{"kappa", "reference"
    (the concurrency of the rows' per-step figures), "concurrency" (every level), "rows": [one
    per method of ``config.drafters``: {"method", "system", every :func:`step_figures`
    field, "tokens_per_s" and "speedup_vs_k0" by concurrency (a string), "levels": by
    concurrency its step figures}]}``; None when the bench ran no kappa > 0 system."""
    cfg = summary["config"]
    labels = [d["label"] for d in cfg.get("drafters") or []]
    levels = sorted(summary["levels"], key=int)
    costs = summary.get("drafter_costs") or {}
    rows = []
    for label in labels:
        row: dict = {"method": label, "system": None, "tokens_per_s": {},
                     "speedup_vs_k0": {}, "levels": {}}
        for key in levels:
            name, s, plain = _method_systems(summary["levels"][key], label)
            if s is None:
                continue
            row["system"] = row["system"] or name
            row["levels"][key] = step_figures(s, costs.get(label))
            row["tokens_per_s"][key] = s.get("median_tokens_per_s")
            row["speedup_vs_k0"][key] = _ratio(s.get("median_tokens_per_s"),
                                               (plain or {}).get("median_tokens_per_s"))
        if not row["levels"]:
            continue
        first = row["levels"][min(row["levels"], key=int)]
        rows.append({**row, **first})
    if not rows:
        return None
    return {"kappa": int(cfg.get("kappa", 0)), "reference": int(min(
        (k for r in rows for k in r["levels"]), key=int)),
        "concurrency": [int(k) for k in levels], "rows": rows}


# -- markdown ---------------------------------------------------------------------------------


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "" if x is None else format(x, fmt)


def human_bytes(n: float | None) -> str:
    """``n`` bytes as ``512 B``, ``12.0 KiB``, ``4.25 MiB``, ``1.10 GiB`` (blank for None)."""
    if n is None:
        return ""
    if n < 1024:
        return f"{n:.0f} B"
    for unit, scale, fmt in (("KiB", 1 << 10, ".1f"), ("MiB", 1 << 20, ".2f"),
                             ("GiB", 1 << 30, ".2f")):
        if n < scale * 1024 or unit == "GiB":
            return f"{n / scale:{fmt}} {unit}"
    return ""  # unreachable


def _alphas(xs: list[float]) -> str:
    return " / ".join(f"{a:.2f}" for a in xs)


def method_table_markdown(summary: dict) -> list[str]:
    """The per-method table as markdown lines (empty without one): a row per method with its
    draft forwards per step, c (and per forward), alpha per position, accepted drafts per
    step, nodes per draft tree, draft weights and KV, seed-state bytes per request and served
    tokens/s (with its ratio to served k=0) at each concurrency; then how each column was
    measured."""
    table = summary.get("per_method")
    if not table:
        return []
    levels = [str(c) for c in table["concurrency"]]
    lines = [f"## per draft method (kappa={table['kappa']}; per-step figures at "
             f"C={table['reference']})", "",
             "| method | draft forwards / step | c = t_draft / t_verify | c per forward | "
             "alpha per position | accepted / step | nodes / tree | draft weights | draft KV | "
             "seed state / request | "
             + " | ".join(f"tokens/s C={c} (x k=0)" for c in levels) + " |",
             "|---" * (10 + len(levels)) + "|"]
    for r in table["rows"]:
        speeds = []
        for c in levels:
            tps, x = r["tokens_per_s"].get(c), r["speedup_vs_k0"].get(c)
            speeds.append("" if tps is None else
                          f"{tps:.2f}" + (f" ({x:.2f}x)" if x is not None else ""))
        lines.append(f"| {r['method']} | {_num(r['forwards_per_step'])} | {_num(r['c'], '.3f')} "
                     f"| {_num(r['c_per_forward'], '.3f')} | {_alphas(r['alpha_per_position'])} "
                     f"| {_num(r['accepted_per_step'])} | {_num(r['tree_nodes_per_tree'], '.1f')} "
                     f"| {human_bytes(r['draft_weights_bytes'])} "
                     f"| {human_bytes(r['draft_kv_pool_bytes'])} "
                     f"| {human_bytes(r['seed_state_bytes_per_request'])} | "
                     + " | ".join(speeds) + " |")
    lines += ["",
              "- draft forwards / step: the drafter's model forwards (a batched call counts "
              "once; catch-up, trees and prepared branches included) / verify steps",
              "- c = t_draft / t_verify: the drafter's propose + branches time per verify "
              "step / the verifier's mean forward (the drafting a step costs, in verify "
              "forwards; it runs in its own process, ahead); c per forward: c / forwards",
              "- alpha per position: the chance draft i is accepted once the ones before it "
              "were; accepted / step: accepted drafts per verify step that carried drafts; "
              "nodes / tree: nodes per draft tree sent (blank: chains only)",
              "- draft weights / KV: as the drafter reports them (a KV that grows per request: "
              "the most it held at once); seed state: prefill -> decode bytes per request",
              "- blank: not measured in this run (not zero)", ""]
    return lines


@dataclass(frozen=True)
class ForwardCost:
    """Median milliseconds of a forward of 1 token and of (kappa+1) tokens per request, for
    ``batch`` requests each after ``context_len`` cached tokens; ``ratio`` = multi / single."""

    context_len: int
    num_tokens: int
    single_ms: float
    multi_ms: float
    batch: int = 1

    @property
    def ratio(self) -> float:
        return self.multi_ms / self.single_ms if self.single_ms else 0.0

    def as_dict(self) -> dict:
        return {"context_len": self.context_len, "num_tokens": self.num_tokens,
                "batch": self.batch, "single_ms": self.single_ms, "multi_ms": self.multi_ms,
                "ratio": self.ratio}


def forward_cost_ratio(model, config, num_speculative_tokens: int, context_len: int = 200,
                       repeats: int = 15, block_size: int = 16, batch: int = 1,
                       kv_cache_dtype: str = "auto") -> ForwardCost:
    """Time forwards of 1 vs ``num_speculative_tokens + 1`` tokens per request of ``model``
    (an ``engine.model.LlamaForCausalLM``) for ``batch`` requests, each after its own
    ``context_len``-token prefix, interleaved, ``repeats`` times each after one warm-up, over
    a KV cache of ``kv_cache_dtype`` (``--kv-cache-dtype``; ``auto``: the model's).

    Raises:
        ValueError: ``num_speculative_tokens < 1``, ``batch < 1``, a context longer than
            the model allows, or a KV cache dtype the model cannot have.
    """
    # torch and the engine's runner: this module is imported by the bench before a model loads
    import torch

    from specmesh.engine.dtypes import resolve_kv_cache_dtype
    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.runner import ModelRunner, SeqChunk

    if num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    k1 = num_speculative_tokens + 1
    if context_len + k1 > config.max_position_embeddings:
        raise ValueError(f"context {context_len} + {k1} exceeds the model's positions")
    num_blocks = -(-(context_len + k1) // block_size)
    runner = ModelRunner(model, config, KVCache(
        config, num_blocks * batch, block_size,
        resolve_kv_cache_dtype(kv_cache_dtype, model.dtype), model.device))
    tables = [list(range(b * num_blocks, (b + 1) * num_blocks)) for b in range(batch)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (context_len + k1,), generator=gen).tolist()
               for _ in range(batch)]
    for prompt, table in zip(prompts, tables):
        runner.prefill(prompt[:context_len], table)
    single, multi = [], []

    def timed(n: int) -> float:
        chunks = [SeqChunk(p[context_len:context_len + n], context_len, t)
                  for p, t in zip(prompts, tables)]
        t0 = time.perf_counter()
        runner.forward(chunks, logits="all")
        return (time.perf_counter() - t0) * 1e3

    timed(1)
    timed(k1)
    for _ in range(repeats):
        single.append(timed(1))
        multi.append(timed(k1))
    return ForwardCost(context_len, k1, statistics.median(single), statistics.median(multi),
                       batch)


__all__ = ["DRAFT_PHASES", "FORWARDS_COUNTER", "ForwardCost", "forward_cost_ratio",
           "human_bytes", "method_table", "method_table_markdown", "step_figures"]
