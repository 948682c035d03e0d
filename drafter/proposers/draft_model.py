"""Standalone draft model: a small causal LM of the target's family and vocabulary drafts by
running ahead of the target (Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", arXiv 2211.17192; vLLM's ``draft_model`` method).

Any Llama-family model :mod:`engine` runs (``engine.model.LlamaForCausalLM``) serves as the
draft model, with its own paged KV cache (``engine.kv_cache.KVCache`` + a
``engine.block_manager.BlockManager``) holding one block table per request. The KV of a
request holds a prefix of its context; ``propose`` catches up on the rest in one chunked
forward, then drafts autoregressively. Token ids, not calls, decide what the KV holds:
whatever context ``propose`` is given is compared with the tokens in the KV and recomputed
from their longest common prefix, so correctness never depends on ``rollback`` being called
(``rollback`` only frees KV early).

Drafts follow the request's sampling (drafter/draft_sampling.py): greedy requests draft by
argmax; seeded ones by the coupled rule's Gumbel-max with the target's noise at each output
position; unseeded sampled ones sample the processed draft distribution (the request's
temperature / top-k / top-p / min-p over the draft logits) and return it as the draft's row
(DraftTailStream.draft_probs), so rejection sampling accepts with ``min(1, target / draft)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specmesh.drafter.draft_lm_kv import DraftLMKV, DraftLMStats, draft_lm_options
from specmesh.drafter.draft_sampling import DraftSampling, target_space_logits, token_probs
from specmesh.drafter.options import Option
from specmesh.drafter.pard_block import common_prefix
from specmesh.drafter.proposer import DraftTarget, Proposer
from specmesh.drafter.registry import register_proposer
from specmesh.drafter.tokenizer_match import check_same_vocabulary
from specmesh.drafter.training.draft_model import train_draft_model
from specmesh.engine.backend import CpuBackend
from specmesh.engine.devices import resolve_device
from specmesh.engine.loader import load_model, load_tokenizer, model_identity, model_name
from specmesh.engine.model import LlamaForCausalLM
from specmesh.engine.sampling import GREEDY
from specmesh.protocol.messages import ModelIdentity

#: default KV memory of the draft model, MiB (SmolLM2-135M fp32: ~5,800 tokens)
DEFAULT_KV_CACHE_MB = 256


@dataclass
class DraftModelStats(DraftLMStats):
    num_recomputes: int = 0  # proposes whose context diverged from the KV's tokens


def _train(prep: dict, args) -> dict:  # noqa: ANN001
    """``specmesh train-drafter --method draft-model``: drafter/training/draft_model.py."""
    return train_draft_model(prep, args)


@register_proposer
class DraftModelProposer(DraftLMKV, Proposer):
    """Drafts with a standalone draft model (module docstring).

    Args:
        model: the draft model: a Hugging Face dir, a ``.gguf`` file or ``"smollm2"``, loaded
            with :func:`engine.loader.load_model` in ``dtype`` on ``device``; ignored when
            ``loaded`` is given.
        dtype: ``"float32"`` (default), ``"bfloat16"``, ``"float64"`` (tests).
        device: torch device of the draft model and its KV.
        num_blocks, block_size: the KV pool, blocks of ``block_size`` tokens; ``num_blocks``
            None: as many as ``kv_cache_mb`` MiB hold.
        max_model_len: longest context + drafts, tokens (default and cap: the draft model's
            ``max_position_embeddings``).
        prefill_chunk_size: most tokens of one catch-up forward.
        target_vocab_size: embedding rows of the target: drafts are argmax over ids below it
            (and below the draft model's rows), so no draft is an id the verifier refuses.
        target_tokenizer, target_name: the target's tokenizer and name for the vocabulary
            check (:func:`drafter.tokenizer_match.check_same_vocabulary`).
        draft_tokenizer: the draft model's tokenizer (default: the one loaded with it).
        loaded: an already loaded draft model: an ``engine.loader.LoadedModel`` or a
            ``LlamaForCausalLM`` (tests; it may be the target's own module: the weights are
            only read).
        backend: the CPU backend (engine/backend.py) ``model`` is loaded with (None: the
            process's default); ignored when ``loaded`` is given.

    Raises:
        ValueError: the tokenizers differ (see ``check_same_vocabulary``); without a target
            tokenizer, a ``target_vocab_size`` different from the draft model's embedding
            rows (the maps cannot be compared); a KV pool of no block; bad sizes.
        FileNotFoundError: ``model`` cannot be found.
    """

    name = "draft_model"
    cli_name = "draft-model"
    summary = "a standalone draft model with the target's tokenizer"
    options = draft_lm_options(
        Option("model", "path", "the draft model: a Hugging Face dir or .gguf with the "
               "target's tokenizer", required=True, positional=True),
        DEFAULT_KV_CACHE_MB)
    trainer = staticmethod(_train)
    max_drafts_per_call = 1  # a forward per draft: stream each one as it is made
    kv_owner = "draft model"
    returns_draft_probs = True
    returns_token_probs = True
    runs_a_model = True

    @classmethod
    def create(cls, kwargs: dict, target: DraftTarget) -> DraftModelProposer:
        """The draft model at ``kwargs["model"]`` for ``target``, whose tokenizer and
        vocabulary size (``target.identity``, read from its config files when None) it must
        match; ``dtype`` / ``device`` default to the cluster's; further ``kwargs`` are
        constructor arguments.

        Raises:
            ValueError: no ``model`` in ``kwargs``, or the vocabularies differ.
            FileNotFoundError: a model cannot be found.
        """
        kwargs = dict(kwargs)
        path = kwargs.pop("model", None)
        if not path:
            raise ValueError("draft method 'draft_model' needs the draft model's path: "
                             "method_kwargs={'model': PATH}")
        identity = target.identity
        if identity is None:
            identity = ModelIdentity(**model_identity(target.model, target.dtype,
                                                      target.block_size, target.kv_cache_dtype))
        dtype = kwargs.pop("dtype", target.dtype)
        device = resolve_device(kwargs.pop("device", target.device))
        return build_draft_model_proposer(path, identity, load_tokenizer(target.model), dtype,
                                          target_name=model_name(target.model), device=device,
                                          backend=target.backend, **kwargs)

    def __init__(self, model: str | None = "smollm2", dtype: str = "float32",
                 device: Any = "cpu", *, num_blocks: int | None = None, block_size: int = 16,
                 kv_cache_mb: int = DEFAULT_KV_CACHE_MB, max_model_len: int | None = None,
                 prefill_chunk_size: int = 512, target_vocab_size: int | None = None,
                 target_tokenizer: Any = None, target_name: str = "target",
                 draft_tokenizer: Any = None, loaded: Any = None,
                 backend: CpuBackend | None = None) -> None:
        if loaded is None:
            loaded = load_model(model, dtype=dtype, device=device, backend=backend)
        if isinstance(loaded, LlamaForCausalLM):
            net, draft_name = loaded, "draft"
        else:  # LoadedModel
            net, draft_name = loaded.model, loaded.name
            draft_tokenizer = draft_tokenizer if draft_tokenizer is not None else loaded.tokenizer
        config = net.config
        if target_tokenizer is not None:
            check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name, draft_name)
        elif target_vocab_size is not None and target_vocab_size != config.vocab_size:
            raise ValueError(
                f"draft model {draft_name!r} has {config.vocab_size} embedding rows, target "
                f"{target_name!r} {target_vocab_size}, and no target tokenizer was given to "
                "check that the two map tokens to the same ids")
        if block_size < 1 or prefill_chunk_size < 1:
            raise ValueError(f"need block_size >= 1 and prefill_chunk_size >= 1, got "
                             f"{block_size}, {prefill_chunk_size}")
        self.model = net
        self.config = config
        self.draft_name = draft_name
        self.stats = DraftModelStats()
        self._init_kv(net, config, num_blocks=num_blocks, block_size=block_size,
                      kv_cache_mb=kv_cache_mb, max_model_len=max_model_len,
                      prefill_chunk_size=prefill_chunk_size, target_vocab_size=target_vocab_size)

    def propose(self, request_id: str, context_token_ids: list[int], num_tokens: int) -> list[int]:
        """Greedy drafts continuing ``context_token_ids`` (see :meth:`propose_sampled`)."""
        return self._draft(request_id, context_token_ids, num_tokens, None)[0]

    def propose_sampled(self, request_id: str, context_token_ids: list[int], num_tokens: int,
                        how: DraftSampling) -> tuple[list[int], list[torch.Tensor | None]]:
        """Drafts continuing ``context_token_ids`` chosen for ``how`` (module docstring), with
        the float32 ``[target vocab_size]`` row of each unseeded sampled draft (zeros at ids
        past the draft model's vocabulary). KV, limits and errors as :meth:`_draft`."""
        return self._draft(request_id, context_token_ids, num_tokens, how)

    def _draft(self, request_id: str, context_token_ids: list[int], num_tokens: int,
               how: DraftSampling | None) -> tuple[list[int], list[torch.Tensor | None]]:
        """Drafts continuing ``context_token_ids`` (greedy when ``how`` is None) and their rows.

        The KV is recomputed from the longest common prefix of the context and the tokens it
        holds (one chunked forward over the rest), then ``num_tokens`` tokens are drafted
        (argmax, or as ``how`` says), one forward each. Afterwards the KV holds the context and
        every draft but the last (a later call whose context is this one plus the drafts feeds
        one token).

        Returns:
            ``num_tokens`` ids or fewer: fewer where ``max_model_len`` or the free KV blocks
            leave no room for more, none (``[]``, logged once) where the context itself does
            not fit or holds an id beyond the draft model's vocabulary. An unknown
            ``request_id`` is opened.
        """
        if num_tokens <= 0 or not context_token_ids:
            return [], []
        ctx = list(context_token_ids)
        seq = self._usable_seq(request_id, ctx)
        if seq is None:
            return [], []
        n_ctx = len(ctx)
        # Keep the common prefix, and at least the last context token to recompute: its
        # logits give the first draft.
        lcp = common_prefix(seq.tokens, ctx[:-1])
        if lcp < min(len(seq.tokens), n_ctx) and seq.tokens[lcp] != ctx[lcp]:
            self.stats.num_recomputes += 1  # the context left the path the KV holds
        self._truncate(seq, lcp)
        n = self._reserve(seq, request_id, n_ctx, num_tokens)
        if n < 1:
            return [], []
        new = ctx[lcp:]
        logits = self._prefill(seq, new, lcp)
        seq.tokens[lcp:] = new
        tok, row = self._pick(logits, how, 0)
        drafts, rows = [tok], [row]
        while len(drafts) < n:
            t = drafts[-1]
            logits = self._prefill(seq, [t], len(seq.tokens))
            seq.tokens.append(t)
            tok, row = self._pick(logits, how, len(drafts))
            drafts.append(tok)
            rows.append(row)
        self.stats.num_tokens_drafted += len(drafts)
        return drafts, rows

    def _pick(self, logits: torch.Tensor, how: DraftSampling | None,
              index: int) -> tuple[int, torch.Tensor | None]:
        """Draft ``index`` of a call from logits [1, vocab]: argmax for greedy requests (and
        ``how`` None), else ``how.choose`` over the target's ids (drafter/draft_sampling.py)."""
        if how is None or (how.mode == GREEDY and not how.processes):
            tok = self._argmax(logits)
            if how is not None and how.token_probs:  # q for the verifier's confidence budget
                return tok, token_probs(logits[:, :self.draft_vocab_limit], [tok])[0]
            return tok, None
        full = target_space_logits(logits[:, :self.draft_vocab_limit], self.target_vocab_size)
        return how.choose(full, index)

    def _argmax(self, logits: torch.Tensor) -> int:
        """logits [1, vocab] -> the id of the largest among the first ``draft_vocab_limit``."""
        return int(logits[0, :self.draft_vocab_limit].argmax())


def build_draft_model_proposer(path: str | None, target_model_config: Any,
                               target_tokenizer: Any, dtype: str = "float32", *,
                               target_name: str = "target", device: Any = "cpu",
                               backend: CpuBackend | None = None,
                               **kwargs: Any) -> DraftModelProposer:
    """A :class:`DraftModelProposer` drafting with the model at ``path`` (Hugging Face dir,
    ``.gguf`` or ``"smollm2"``) for a target described by ``target_model_config`` (anything
    with ``vocab_size``, its embedding rows: an ``engine.config.ModelConfig`` or a
    ``protocol.messages.ModelIdentity``) and ``target_tokenizer``; ``kwargs`` are further
    constructor arguments (``num_blocks``, ``block_size``, ``kv_cache_mb``, ...); ``backend``
    the CPU backend the draft model computes with (engine/backend.py; None: the process's).

    Raises:
        ValueError: the vocabularies differ (the message names both models and the first
            differing token), an unsupported dtype or architecture.
        FileNotFoundError: ``path`` cannot be found.
    """
    loaded = load_model(path, dtype=dtype, device=device, backend=backend)
    return DraftModelProposer(dtype=dtype, device=device, loaded=loaded,
                              target_vocab_size=int(target_model_config.vocab_size),
                              target_tokenizer=target_tokenizer, target_name=target_name,
                              **kwargs)
