"""The three workers in one process, wired by an in-process hub that carries real encoded
messages and frames: the test harness of decode/, ``specmesh generate`` and the plain-decode
baseline of benchmarks. Imports no Ray (the import-direction test enforces it)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from specmesh.cluster.prefill_seeder import seeder_of
from specmesh.decode.config import VerifierConfig
from specmesh.decode.rules import outputs_exact
from specmesh.decode.worker import VerifierWorker
from specmesh.drafter.config import DrafterConfig
from specmesh.drafter.proposer import Proposer
from specmesh.drafter.registry import (create_proposer, get_method, makes_prefill_seed,
                                      seed_state_for, seed_state_kinds)
from specmesh.drafter.worker import DrafterWorker
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.config import ModelConfig
from specmesh.engine.dtypes import resolve_kv_cache_dtype
from specmesh.engine.grammar import GrammarCompiler
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner
from specmesh.engine.shared_kv import SharedKVFile
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.worker import PrefillWorker
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.messages import (PROTOCOL_VERSION, GenerateRequest, Hello, SamplingParams,
                                        TokenLogprobs, TokenStream)
from specmesh.protocol.spec_stats import SpecStats
from specmesh.protocol.transport import InProcHub

VERIFIER = "verifier-0"


@dataclass
class Completion:
    """One finished request: output tokens and the spec stats the verifier reported (with
    the prediction drafts it accepted and rejected, for a request with a prediction)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str = ""
    num_prompt_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    #: the output's logprobs, one part per TokenStream, and the prompt's (when asked)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: TokenLogprobs | None = None

    def add(self, msg: TokenStream, synthetic_acceptance: bool = False) -> None:
        """Take in one TokenStream of the request (``synthetic_acceptance``: the cluster's
        verifier runs the synthetic-acceptance ablation, by its configuration)."""
        self.token_ids.extend(msg.token_ids)
        self.finish_reason = FinishReason(msg.finish_reason) if msg.finish_reason else None
        self.error = msg.error
        self.num_prompt_tokens = msg.num_prompt_tokens
        self.spec = SpecStats(msg.num_draft_tokens, msg.num_accepted_tokens,
                              msg.num_verify_steps, synthetic_acceptance)
        self.num_accepted_prediction_tokens = msg.num_accepted_prediction_tokens
        self.num_rejected_prediction_tokens = msg.num_rejected_prediction_tokens
        if msg.logprobs is not None:
            self.logprobs.append(msg.logprobs)
        if msg.prompt_logprobs is not None:
            self.prompt_logprobs = msg.prompt_logprobs


class InProcessCluster:
    """Prefill, verifier and drafter workers over one shared model, each with its own KV cache.

    ``proposer`` replaces the drafter's registered method (tests plug oracle / garbage
    drafters in); the seed state prefill and verifier ship is the one ``proposer`` declares,
    else the registered ``draft_method``'s; ``num_speculative_tokens=0`` is plain decode
    through the same verifier;
    ``drafter_options`` are further ``DrafterConfig`` fields (e.g. ``seed``, ``draft_probs``);
    ``prefill_options`` further ``PrefillConfig`` fields (e.g. ``max_batch_tokens``);
    ``verifier_options`` are further ``VerifierConfig`` fields (e.g. ``max_queue_len``).
    ``kv_cache_dtype``: both KV caches' dtype (``--kv-cache-dtype``; ``auto``: the model's).
    ``tokenizer``: the target's Hugging Face tokenizer, for structured output (requests with
    a ``SamplingParams.grammar``); None: such requests are refused.
    ``prefill_draft_seed`` (``--prefill-draft-seed``): the prefill runs the draft method's first
    step (PrefillDone.draft_seed, cluster/prefill_seeder.py) with ``prefill_seeder`` (a
    proposer of the method; default: one built from the registry as the drafter's is, when no
    ``proposer`` replaces the method; a given ``proposer`` gets no seeder unless one is passed).

    Raises:
        ValueError: a KV cache dtype the model cannot have (engine/dtypes.py), or a setting
            the workers' configs refuse.
    """

    def __init__(self, model, config: ModelConfig, *, num_speculative_tokens: int = 4,
                 eos_token_ids: tuple[int, ...] = (), num_kv_blocks: int = 512,
                 block_size: int = 16, max_model_len: int | None = None,
                 draft_method: str = "ngram", proposer: Proposer | None = None,
                 window: int | None = None, prefill_chunk_size: int = 512,
                 max_num_seqs: int = 64, drafter_options: dict | None = None,
                 prefill_options: dict | None = None, kv_cache_dtype: str = "auto",
                 tokenizer=None, prefill_draft_seed: bool = True,
                 prefill_seeder: Proposer | None = None,
                 **verifier_options) -> None:  # noqa: ANN001
        self.hub = InProcHub()
        dtype = resolve_kv_cache_dtype(kv_cache_dtype, model.dtype)

        def runner(shared: bool = False) -> tuple[ModelRunner, BlockManager]:
            pool = SharedKVFile(VERIFIER, (config.num_layers, 2, num_kv_blocks * block_size,
                                           config.num_kv_heads, config.head_dim),
                                dtype, block_size) if shared else None
            cache = KVCache(config, num_kv_blocks, block_size, dtype, model.device,
                            storage=pool.tensor if pool is not None else None)
            cache.shared_file = pool
            return ModelRunner(model, config, cache), BlockManager(num_kv_blocks, block_size)

        # a frozen-KV drafter reads the verifier's KV: in shared memory, as served
        reads_kv = getattr(proposer if proposer is not None else get_method(draft_method),
                           "reads_target_kv", False)
        p_runner, p_bm = runner()
        v_runner, v_bm = runner(shared=reads_kv)
        seed = proposer.seed_state if proposer is not None else seed_state_for(
            draft_method, (drafter_options or {}).get("method_kwargs"))
        self.prefill = PrefillWorker(
            PrefillConfig(chunk_size=prefill_chunk_size,
                          seed_states={**seed_state_kinds(), draft_method: seed},
                          **(prefill_options or {})),
            self.hub.mailbox("prefill-0"), p_runner, p_bm)
        if prefill_draft_seed and prefill_seeder is None and proposer is None \
                and makes_prefill_seed(draft_method):  # as the drafter builds its own
            prefill_seeder = create_proposer(draft_method,
                                             (drafter_options or {}).get("method_kwargs"))
        if prefill_draft_seed and prefill_seeder is not None:
            self.prefill.draft_seeders = {draft_method: seeder_of(prefill_seeder)}
        max_len = max_model_len or min(config.max_position_embeddings, num_kv_blocks * block_size)
        self.verifier = VerifierWorker(
            VerifierConfig(num_speculative_tokens=num_speculative_tokens,
                           eos_token_ids=tuple(eos_token_ids),
                           max_model_len=max_len, tail_wait_fraction=0.0,
                           draft_method=draft_method, seed_state=seed,
                           max_num_seqs=max_num_seqs,
                           **verifier_options),
            self.hub.mailbox(VERIFIER), v_runner, v_bm,
            prefill_peers=["prefill-0"], drafter_peers=["drafter-0"])
        # (under the schedule policy, from the schedule's largest kappa)
        w = window or DrafterConfig.default_window(self.verifier.config.widest_kappa)
        # branches hide drafting latency from a verifier that runs meanwhile; stepped in turn
        # here, the drafter's whole window is ready before every verify step: off by default
        # prediction drafts run two verify steps of num_prediction_tokens ahead, as served
        pw = max(DrafterConfig.default_window(self.verifier.config.num_prediction_tokens), w)
        d_opts = {"num_branches": 0, "prediction_window": pw, **(drafter_options or {})}
        self.drafter = DrafterWorker(DrafterConfig(method=draft_method, window=w, max_segment=w,
                                                   **d_opts),
                                     self.hub.mailbox("drafter-0"), proposer)
        if reads_kv:  # the Hello a served verifier sends, and the drafter's check of it
            self.verifier.lifecycle.share_kv = True
            why = self.drafter.proposer.check_verifier_hello(VERIFIER, Hello(
                protocol_version=PROTOCOL_VERSION, role="verifier", instance_id=VERIFIER,
                incarnation=1, shared_kv=v_runner.kv_cache.shared_file.describe()))
            if why:
                raise ValueError(why)
        if tokenizer is not None:  # structured output: both roles mask (engine/grammar.py)
            grammars = GrammarCompiler(tokenizer, tuple(eos_token_ids), config.vocab_size)
            self.verifier.set_grammar_compiler(grammars)
            self.prefill.grammars = grammars
        self.client = self.hub.mailbox("gateway-0")
        self._ids = itertools.count()

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 num_speculative_tokens: int | None = None, timeout_s: float = 3600.0,
                 predictions: list[list[int] | None] | None = None,
                 groups: list[str] | None = None) -> list[Completion]:
        """Submit all prompts at once (continuous batching) and step the workers until every
        request finished. Returns completions in prompt order. ``predictions``: each prompt's
        predicted output token ids (OpenAI Predicted Outputs; None: none). ``groups``: each
        prompt's sibling group (the ``n`` choices of one prompt, decode/siblings.py; "": none),
        its size the number of prompts that name it.

        Raises:
            TimeoutError: not finished within ``timeout_s`` seconds.
        """
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [f"req-{next(self._ids)}" for _ in prompts]
        results = {rid: Completion(rid) for rid in ids}
        groups = groups or [""] * len(prompts)
        for rid, prompt, sp, pred, group in zip(ids, prompts, params,
                                                predictions or [None] * len(prompts), groups):
            self.client.send(VERIFIER, GenerateRequest(
                request_id=rid, prompt_token_ids=list(prompt), sampling=sp,
                num_speculative_tokens=num_speculative_tokens,
                prediction_token_ids=None if pred is None else list(pred),
                group=group, group_size=groups.count(group) if group else 1))
        pending = set(ids)
        # the gateway's flag, from the configuration: drafts accepted by a rule that is not
        # exact (synthetic acceptance)
        synthetic = not outputs_exact(self.verifier.config.verify_rule)
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} requests unfinished after {timeout_s} s")
            # the drafter drafts all it has room for before the verifier steps (a model
            # drafter streams one draft per call: step it until its window is full)
            for _ in range(max(self.drafter.config.window, 1)):
                if not self.drafter.step() and not self.drafter._has_work():
                    break
            self.prefill.step()
            self.verifier.step()
            for env in self.client.drain():
                msg = env.msg
                if isinstance(msg, TokenStream) and msg.request_id in results:
                    results[msg.request_id].add(msg, synthetic)
                    if msg.finished:
                        pending.discard(msg.request_id)
        return [results[rid] for rid in ids]
