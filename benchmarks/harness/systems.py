"""The systems ``specmesh bench`` compares, each run over a list of prompts into a
:class:`cluster.runs.RunResult`:

- served: C concurrent ``openai`` clients through the gateway of a running cluster, each
  request streamed (SSE: its TTFT and inter-token latency), kappa switched on the same cluster
  with ``ClusterHandle.set_num_speculative_tokens`` (:func:`run_served`);
- in-process: prefill, verifier and drafter workers in the bench's own process
  (:class:`cluster.inprocess.InProcessCluster`, no Ray, no HTTP), at kappa = K per draft
  method and kappa = 0, with as many requests in flight as the concurrency level, so served /
  in-process ratios come from the same run (:class:`InProcessSystems`);
- Hugging Face: batched greedy ``generate`` (left padding, attention mask) and, one prompt at
  a time, ``generate`` with prompt lookup (transformers does not batch prompt lookup), in the
  bench's own process on its own model copy (:func:`run_hf`);
- llama.cpp's ``llama-server``: benchmarks/harness/llama_server.py.

The verifiers' counters and step profiles are read before and after each specmesh pass
(:func:`benchmarks.harness.report.snapshot_delta`), so a pass gets its own per-position
accepts and profile. Imports no torch and no Ray at load.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from specmesh.benchmarks.harness.report import (
    kappa_timeline,
    merge_snapshots,
    snapshot_delta,
    verifier_snapshot,
    with_drafter_profiles,
)
from specmesh.cluster.runs import (
    RunResult,
    clear_drafter_history,
    prediction_body,
    run_openai_concurrent,
)
from specmesh.gateway.tokens import chat_prompt_ids
from specmesh.protocol.messages import SamplingParams


# -- Hugging Face -----------------------------------------------------------------------------


def load_hf_model(model: str | None = None, dtype: str = "float32") -> Any:
    """The transformers model (eval) with the weights specmesh serves for ``model``: the
    Hugging Face baseline of the bench (and the reference of the exactness tests)."""
    # transformers and the engine: only when the HF baseline runs
    from transformers import AutoModelForCausalLM

    from specmesh.engine.dtypes import model_dtype
    from specmesh.engine.loader import model_files

    path = model_files(model, dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(dtype)).eval()


def generation_eos_ids(hf_model) -> list[int]:
    """The end-of-sequence ids of the model's generation config (a list, maybe empty)."""
    eos = hf_model.generation_config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def cut_at_eos(token_ids: list[int], eos_ids: list[int]) -> list[int]:
    """``token_ids`` up to and including the first end-of-sequence id (what specmesh emits:
    nothing past the end)."""
    for i, t in enumerate(token_ids):
        if t in eos_ids:
            return token_ids[: i + 1]
    return token_ids


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Left-pad token id lists to one length: (input ids, attention mask with 0 on pads)."""
    n = max(len(ids) for ids in batch)
    ids = [[pad_id] * (n - len(x)) + list(x) for x in batch]
    mask = [[0] * (n - len(x)) + [1] * len(x) for x in batch]
    return ids, mask


def run_hf(hf_model, tokenizer, prompts: list[dict], max_tokens: int, system: str,
           eos_ids: list[int], batch_size: int = 1,
           prompt_lookup: int | None = None) -> RunResult:
    """Greedy Hugging Face ``generate`` over ``prompts`` in batches of ``batch_size`` (left
    padding and an attention mask); with ``prompt_lookup`` (draft tokens per step) one prompt
    at a time. Completion tokens count up to and including the first EOS; ``seconds`` is the
    wall time of all batches, ``request_seconds`` each request's batch's.

    Raises:
        ValueError: ``prompt_lookup`` with ``batch_size`` > 1.
    """
    import torch  # torch: only when a system runs

    if prompt_lookup and batch_size > 1:
        raise ValueError("transformers' prompt lookup decoding runs one prompt at a time")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        eos_ids[0] if eos_ids else 0)
    res = RunResult(system, token_ids=[], concurrency=batch_size)
    kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    all_ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts]
    t0 = time.perf_counter()
    for start in range(0, len(all_ids), batch_size):
        ids, mask = left_pad(all_ids[start:start + batch_size], pad_id)
        ids_t = torch.tensor(ids)
        t_batch = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids_t, attention_mask=torch.tensor(mask), do_sample=False,
                                    max_new_tokens=max_tokens, eos_token_id=eos_ids or None,
                                    pad_token_id=pad_id, temperature=None, top_p=None,
                                    top_k=None, **kw)
        took = time.perf_counter() - t_batch
        for row in out[:, ids_t.shape[1]:].tolist():
            res.request_seconds.append(took)
            new = cut_at_eos(row, eos_ids)
            res.token_ids.append(new)
            res.num_tokens += len(new)
    res.seconds = time.perf_counter() - t0
    res.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in res.token_ids]
    return res


# -- in-process -------------------------------------------------------------------------------

#: Extra KV blocks per request beyond prompt + max_tokens + kappa + 1 (partial blocks, slack).
EXTRA_BLOCKS_PER_REQUEST = 2


def kv_blocks_needed(max_prompt_len: int, max_tokens: int, kappa: int, concurrency: int,
                     block_size: int) -> int:
    """KV blocks for ``concurrency`` requests of at most ``max_prompt_len`` prompt tokens and
    ``max_tokens`` completion tokens, with kappa + 1 look-ahead slots each."""
    per_request = -(-(max_prompt_len + max_tokens + kappa + 1) // block_size)
    return concurrency * (per_request + EXTRA_BLOCKS_PER_REQUEST)


class InProcessSystems:
    """In-process clusters over one loaded model (``engine.loader.load_model``), one per
    (draft method, kappa, concurrency), built on first use; ``max_num_seqs`` = concurrency, so
    the verifier runs at most that many requests at once and the rest queue, like C concurrent
    clients. ``methods``: label -> the ClusterConfig running that method (its proposer is
    built as the drafter role builds it, :func:`cluster.hosts.drafter.build_proposer`); no
    methods: n-gram only. ``verifier_options``:
    further VerifierConfig fields of every kappa > 0 cluster (the deployment's
    ``verify_rule`` and ``synthetic_acceptance``, so in-process and served systems verify
    alike). ``kv_cache_dtype``: every cluster's KV cache dtype (``--kv-cache-dtype``)."""

    def __init__(self, loaded, max_prompt_len: int, max_tokens: int,
                 block_size: int = 16, methods: dict | None = None,
                 verifier_options: dict | None = None, kv_cache_dtype: str = "auto") -> None:
        self.loaded, self.max_prompt_len, self.max_tokens = loaded, max_prompt_len, max_tokens
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        self.methods = dict(methods or {})
        self.verifier_options = dict(verifier_options or {})
        self._clusters: dict[tuple[str | None, int, int], object] = {}

    def _method(self, method: str | None) -> tuple[str, object]:
        """(registry method, proposer or None) of the method labelled ``method``.

        Raises:
            KeyError: a label the systems were not given.
        """
        if method is None:
            return "ngram", None
        if method not in self.methods:
            raise KeyError(f"in-process systems have no draft method {method!r} "
                           f"(have {sorted(self.methods)})")
        from specmesh.cluster.hosts.drafter import build_proposer  # torch: a model drafter

        cfg = self.methods[method]
        return cfg.drafter.method, build_proposer(cfg)

    def cluster(self, kappa: int, concurrency: int, method: str | None = None):
        """The in-process cluster for ``kappa`` drafts per step, ``concurrency`` requests and
        the draft method labelled ``method`` (ignored at kappa 0: plain decode)."""
        key = (method if kappa > 0 else None, kappa, concurrency)
        if key not in self._clusters:
            # the in-process workers: torch and the triton kernels
            from specmesh.cluster.inprocess import InProcessCluster

            draft_method, proposer = self._method(key[0])
            cfg = self.loaded.config
            blocks = kv_blocks_needed(self.max_prompt_len, self.max_tokens, kappa, concurrency,
                                      self.block_size)
            self._clusters[key] = InProcessCluster(
                self.loaded.model, cfg, num_speculative_tokens=kappa,
                eos_token_ids=cfg.eos_token_ids, num_kv_blocks=blocks,
                block_size=self.block_size, max_num_seqs=concurrency,
                max_model_len=min(cfg.max_position_embeddings,
                                  self.max_prompt_len + self.max_tokens + kappa + 1),
                draft_method=draft_method, proposer=proposer,
                kv_cache_dtype=self.kv_cache_dtype,
                **(self.verifier_options if kappa > 0 else {}))
        return self._clusters[key]

    def run(self, prompt_ids: list[list[int]], kappa: int, concurrency: int,
            system: str, method: str | None = None) -> RunResult:
        """All ``prompt_ids`` through the (method, kappa, concurrency) cluster, greedy;
        ``seconds`` is the wall time until the last finished. Spec stats from the completions,
        per-position accepts and the verifier's step profile from its counters over this
        pass. The drafter's cross-request memory is cleared first (``Proposer.clear_history``,
        as the served passes clear theirs through the gateway), so no request is drafted from
        its own earlier run.

        Raises:
            RuntimeError: a request did not finish successfully.
        """

        c = self.cluster(kappa, concurrency, method)
        c.drafter.proposer.clear_history()
        before = self._snapshot(c)
        t0 = time.perf_counter()
        outs = c.generate(prompt_ids, SamplingParams(max_tokens=self.max_tokens))
        seconds = time.perf_counter() - t0
        delta = snapshot_delta(before, self._snapshot(c))
        bad = [o for o in outs if o.finish_reason is None or not o.finish_reason.is_success]
        if bad:
            raise RuntimeError(f"{system}: request {bad[0].request_id} failed: {bad[0].error}")
        res = RunResult(system, seconds=seconds, token_ids=[o.token_ids for o in outs],
                        concurrency=concurrency, profile=delta["profile"],
                        accepted_per_pos=delta["num_accepted_tokens_per_pos"])
        for o in outs:
            res.num_tokens += len(o.token_ids)
            res.spec.add(o.spec)
            res.request_spec.append(o.spec)
        tok = self.loaded.tokenizer
        res.texts = [tok.decode(t, skip_special_tokens=True) for t in res.token_ids]
        return res

    @staticmethod
    def _snapshot(c) -> dict:
        stats = vars(c.verifier.stats)
        return with_drafter_profiles(
            verifier_snapshot({**stats, "profile": c.verifier.profile.as_dict()}),
            [c.drafter.profile.as_dict()])


# -- served -----------------------------------------------------------------------------------


def check_predictions(client, model: str, prompts: list[dict]) -> bool:
    """Send the first prompt that has a ``prediction`` with it (4 tokens), so a server
    without Predicted Outputs fails the bench before its passes; False (nothing sent) when no
    prompt has one.

    Raises:
        SystemExit: the server refused the request (HTTP 400), naming its message and
            ``--predictions off``.
    """
    import openai  # openai: only when the served systems run

    prompt = next((p for p in prompts if p.get("prediction")), None)
    if prompt is None:
        return False
    try:
        client.chat.completions.create(model=model, messages=prompt["messages"], max_tokens=4,
                                       temperature=0, extra_body=prediction_body(prompt))
    except openai.BadRequestError as e:
        raise SystemExit(f"the served cluster refused a prompt's prediction (OpenAI's "
                         f"Predicted Outputs, prompt {prompt['name']!r}): {e}; run the bench "
                         f"with --predictions off, or on a server that takes them") from None
    return True


def served_snapshot(handle) -> dict:
    """The summed counters and step profiles of the cluster's verifiers, with the drafters'
    step profiles under ``drafter <phase>`` (one Ray call each)."""
    import ray  # ray: only for the served systems, after use_loopback()

    stats = ray.get([a.stats.remote() for a in handle.verifiers()])
    drafted = ray.get([a.stats.remote() for a in handle.drafters()])
    return with_drafter_profiles(merge_snapshots([verifier_snapshot(s) for s in stats]),
                                 [d.get("profile") or {} for d in drafted])


#: what a drafter's stats report of its method's cost (drafter/draft_memory.py COST_FIELDS)
DRAFTER_COST_FIELDS = ("draft_weights_bytes", "draft_kv_pool_bytes", "num_draft_forwards")


def served_drafter_costs(handle) -> dict:
    """The cost fields its method reports (:data:`DRAFTER_COST_FIELDS`: weights and draft KV
    bytes, forwards so far) in the stats of the cluster's first drafter; those it does not
    report are left out (the bench's per-method table shows them blank). Empty without a
    drafter."""
    import ray  # ray: only for the served systems, after use_loopback()

    stats = ray.get([a.stats.remote() for a in handle.drafters()])
    return {k: stats[0][k] for k in DRAFTER_COST_FIELDS if k in stats[0]} if stats else {}


class KappaSampler:
    """While open, samples the verifiers of ``handle`` every ``interval_s``: the policy's
    kappa (``current_kappa`` of their stats: the schedule's step kappa, else the configured
    one) and the drafts and request steps verified so far (two step-profile counters counted
    together, so a sample taken mid-step stays consistent); :attr:`timeline` is
    :func:`benchmarks.harness.report.kappa_timeline` of them once closed (one sample before
    the pass, one after it, the rest in a thread)."""

    def __init__(self, handle, interval_s: float = 0.5) -> None:
        self.handle = handle
        self.interval_s = interval_s
        self.samples: list[tuple[float, int, int, int]] = []
        self.timeline: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kappa-sampler")

    def _sample(self) -> None:
        import ray  # ray: only for the served systems, after use_loopback()

        stats = ray.get([a.stats.remote() for a in self.handle.verifiers()])
        counters = [(s.get("profile") or {}).get("counters", {}) for s in stats]
        self.samples.append((time.monotonic() - self._t0,
                             max((int(s.get("current_kappa", 0)) for s in stats), default=0),
                             sum(c.get("num_request_step_drafts", 0) for c in counters),
                             sum(c.get("num_request_steps", 0) for c in counters)))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> KappaSampler:
        self._t0 = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.timeline = kappa_timeline(self.samples)


def run_served(handle, client, model: str, prompts: list[dict], max_tokens: int, kappa: int,
               concurrency: int, system: str, stream: bool = True, predictions: bool = False,
               clear_history: bool = True) -> RunResult:
    """Set kappa on every verifier; with ``clear_history``, empty the drafters'
    cross-request memory through the cluster's gateway
    (:func:`cluster.runs.clear_drafter_history`; ``history_cleared`` False when the server
    has no such endpoint), so no request of the pass is drafted from an earlier pass's output
    of its own prompt; then send ``prompts`` from ``concurrency`` clients
    (:func:`cluster.runs.run_openai_concurrent`; ``stream``: over SSE, each request's TTFT and
    inter-token latency recorded), with each prompt's ``prediction`` when ``predictions`` and
    kappa > 0 (kappa = 0 stays the plain-decode reference, so the output-identity check also
    shows that a prediction changes no output). Adds the verifiers' per-position accepts and
    step profile over the pass. Tokens/s = completion tokens / wall seconds of the pass.

    Raises:
        RuntimeError: the gateway answered the clear with an error other than 404.
    """
    handle.set_num_speculative_tokens(kappa)
    cleared = clear_drafter_history(handle.url, api_key=handle.api_key) if clear_history \
        else None
    before = served_snapshot(handle)
    res = run_openai_concurrent(client, model, prompts, max_tokens, system, concurrency,
                                stream=stream, predictions=predictions and kappa > 0)
    res.history_cleared = cleared
    delta = snapshot_delta(before, served_snapshot(handle))
    res.accepted_per_pos = delta["num_accepted_tokens_per_pos"]
    res.profile = delta["profile"]
    return res
