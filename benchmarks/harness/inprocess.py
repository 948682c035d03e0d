"""The in-process specmesh systems of ``specmesh bench``: prefill, verifier and drafter workers
in the bench's own process (:class:`cluster.inprocess.InProcessCluster`, no Ray, no HTTP), at
kappa = K per draft method and kappa = 0, with as many requests in flight as the concurrency
level, so served / in-process ratios come from the same run. Imports no Ray."""

from __future__ import annotations

import time

from specmesh.benchmarks.harness.stats import snapshot_delta, verifier_snapshot, with_drafter_profiles
from specmesh.cluster.runs import RunResult

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
    built as the drafter role builds it, :func:`cluster.hosts.drafter.build_proposer`; None
    for a registry method such as n-gram); no methods: n-gram only. ``verifier_options``:
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
        from specmesh.cluster.hosts.drafter import build_proposer

        cfg = self.methods[method]
        return cfg.drafter.method, build_proposer(cfg)

    def cluster(self, kappa: int, concurrency: int, method: str | None = None):
        """The in-process cluster for ``kappa`` drafts per step, ``concurrency`` requests and
        the draft method labelled ``method`` (ignored at kappa 0: plain decode)."""
        key = (method if kappa > 0 else None, kappa, concurrency)
        if key not in self._clusters:
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
        pass.

        Raises:
            RuntimeError: a request did not finish successfully.
        """
        from specmesh.protocol.messages import SamplingParams

        c = self.cluster(kappa, concurrency, method)
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
        tok = self.loaded.tokenizer
        res.texts = [tok.decode(t, skip_special_tokens=True) for t in res.token_ids]
        return res

    @staticmethod
    def _snapshot(c) -> dict:
        stats = vars(c.verifier.stats)
        return with_drafter_profiles(
            verifier_snapshot({**stats, "profile": c.verifier.profile.as_dict()}),
            [c.drafter.profile.as_dict()])
