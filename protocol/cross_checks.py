"""Checks of decoded wire messages that span fields (run by protocol/codec.py after msgspec has
checked each field's type and bounds): a DraftTailStream's ``parents`` one per draft and pointing
inside the segment, ``start_pos >= base_committed_len``, ``draft_probs`` rows = drafts, a
prediction segment a chain without ``draft_probs``, ``draft_confidences`` and
``draft_token_probs`` one per draft in [0, 1]; a
DraftBranches' continuations one per candidate, non-empty, candidates distinct; a corpus
operation's op, name and chunks (:func:`check_drafter_corpus`), its results' op and status. Each
check
returns "" when the message is fine, else why not (the codec raises it as a ProtocolError).
Constructing a message locally runs none of them.

:func:`draft_seed_error` is not one of the codec's checks: a malformed DraftSeed must not fail
the PrefillDone or DraftSync that carries it, so its receivers call it and drop the seed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from specmesh.protocol.enums import CorpusOp, CorpusStatus, LoraOp
from specmesh.protocol.messages import (
    CORPUS_CHUNK_TOKENS,
    MAX_DRAFT_SEED_TOPK,
    MAX_CORPUS_NAME_LEN,
    MAX_CORPUS_TOKENS,
    MAX_LORA_ADAPTERS,
    DraftBranches,
    DrafterCorpus,
    DraftSeed,
    DrafterCorpusRelayed,
    DrafterCorpusResult,
    DraftTailStream,
    LoraAdapterOp,
    LoraAdapterResult,
    PrefillDone,
    TokenLogprobs,
    TokenStream,
)

_CORPUS_NAME = re.compile(r"[A-Za-z0-9._-]+")
_OPS = frozenset(o.value for o in CorpusOp)
_STATUSES = frozenset(s.value for s in CorpusStatus)
#: most chunks a load may announce (MAX_CORPUS_TOKENS in full chunks)
MAX_CORPUS_CHUNKS = -(-MAX_CORPUS_TOKENS // CORPUS_CHUNK_TOKENS)


def check_draft_tail(m: DraftTailStream) -> str:
    """Why segment ``m`` is malformed ("" when it is not)."""
    n = len(m.draft_token_ids)
    if m.start_pos < m.base_committed_len:
        return (f"start_pos {m.start_pos} < base_committed_len {m.base_committed_len} (a "
                "segment starts at or after the drafter's committed prefix)")
    if m.parents is not None:
        if len(m.parents) != n:
            return f"{len(m.parents)} parents for {n} draft tokens"
        for i, p in enumerate(m.parents):
            if not -1 <= p < i:
                return f"parents[{i}] = {p} is not -1 or an earlier token of the segment"
    if m.draft_probs is not None:
        shape = tuple(m.draft_probs.shape)
        if len(shape) != 2 or shape[0] != n:
            return f"draft_probs of shape {list(shape)} for {n} draft tokens (want [{n}, vocab])"
    if m.from_prediction and (m.draft_probs is not None or m.parents is not None):
        return ("a prediction segment with draft_probs or parents (prediction drafts are "
                "deterministic: a chain verified one-hot)")
    for name in ("draft_confidences", "draft_token_probs"):
        values = getattr(m, name)
        if values and len(values) != n:
            return f"{len(values)} {name} for {n} draft tokens"
        if not all(0.0 <= c <= 1.0 for c in values):  # NaN fails too
            return f"{name} outside [0, 1] (a probability per draft)"
    return ""


def check_draft_branches(m: DraftBranches) -> str:
    """Why branches ``m`` are malformed ("" when they are not)."""
    if m.position < m.base_committed_len:
        return (f"position {m.position} < base_committed_len {m.base_committed_len} (a branch "
                "hangs at or after the drafter's committed prefix)")
    if len(m.continuations) != len(m.token_ids):
        return f"{len(m.continuations)} continuations for {len(m.token_ids)} candidates"
    if any(not c for c in m.continuations):
        return "an empty continuation"
    if len(set(m.token_ids)) != len(m.token_ids):
        return "repeated candidate tokens"
    return ""


def corpus_name_error(name: object) -> str:
    """Why ``name`` cannot name a corpus ("" when it can): names are 1..MAX_CORPUS_NAME_LEN
    characters of ``[A-Za-z0-9._-]`` (they appear in URL paths and logs)."""
    if type(name) is not str or not name:
        return "a corpus name must be a non-empty string"
    if len(name) > MAX_CORPUS_NAME_LEN:
        return f"a corpus name has at most {MAX_CORPUS_NAME_LEN} characters, got {len(name)}"
    if not _CORPUS_NAME.fullmatch(name):
        return f"corpus name {name!r} may only hold letters, digits, '.', '_' and '-'"
    return ""


def _op_and_name_error(op: str, name: str) -> str:
    if op not in _OPS:
        return f"unknown corpus op {op!r} (one of {', '.join(sorted(_OPS))})"
    if op == CorpusOp.CLEAR_HISTORY:
        return f"clear_history names no corpus, got name {name!r}" if name else ""
    return corpus_name_error(name)


def check_drafter_corpus(m: DrafterCorpus) -> str:
    """Why corpus operation ``m`` is malformed ("" when it is not)."""
    why = _op_and_name_error(m.op, m.name)
    if why:
        return why
    if m.chunk_index >= m.num_chunks:
        return f"chunk_index {m.chunk_index} >= num_chunks {m.num_chunks}"
    if m.op != CorpusOp.LOAD:
        if m.token_ids or m.num_chunks != 1:
            return f"a {m.op} carries no token ids and one chunk"
        return ""
    if m.num_chunks > MAX_CORPUS_CHUNKS:
        return (f"{m.num_chunks} chunks: a corpus has at most {MAX_CORPUS_TOKENS} tokens "
                f"({MAX_CORPUS_CHUNKS} chunks)")
    if not m.token_ids:
        return "an empty load chunk"
    if len(m.token_ids) > CORPUS_CHUNK_TOKENS:
        return f"a chunk of {len(m.token_ids)} tokens > CORPUS_CHUNK_TOKENS={CORPUS_CHUNK_TOKENS}"
    return ""


def check_corpus_relayed(m: DrafterCorpusRelayed) -> str:
    """Why relay report ``m`` is malformed ("" when it is not)."""
    return _op_and_name_error(m.op, m.name)


def check_corpus_result(m: DrafterCorpusResult) -> str:
    """Why corpus result ``m`` is malformed ("" when it is not)."""
    if m.status not in _STATUSES:
        return f"unknown corpus status {m.status!r} (one of {', '.join(sorted(_STATUSES))})"
    return _op_and_name_error(m.op, m.name)


_LORA_OPS = frozenset(o.value for o in LoraOp)


def check_lora_op(m: LoraAdapterOp) -> str:
    """Why LoRA operation ``m`` is malformed ("" when it is not): an unknown op, a load
    without name or path, an unload without a name, a sync with a name or path of its own or
    too many adapters."""
    if m.op not in _LORA_OPS:
        return f"unknown LoRA op {m.op!r} (one of {', '.join(sorted(_LORA_OPS))})"
    if m.op == LoraOp.SYNC:
        if m.lora_name or m.lora_path:
            return "a LoRA sync names its adapters in adapters only"
        if len(m.adapters) > MAX_LORA_ADAPTERS:
            return f"a LoRA sync of {len(m.adapters)} adapters > {MAX_LORA_ADAPTERS}"
        if any(not k or not v for k, v in m.adapters.items()):
            return "a LoRA sync with an empty adapter name or path"
        return ""
    if not m.lora_name:
        return f"a LoRA {m.op} without lora_name"
    if m.op == LoraOp.LOAD and not m.lora_path:
        return "a LoRA load without lora_path"
    if m.adapters:
        return f"a LoRA {m.op} carries no adapters list"
    return ""


def check_lora_result(m: LoraAdapterResult) -> str:
    """Why LoRA result ``m`` is malformed ("" when it is not)."""
    if m.op not in _LORA_OPS:
        return f"unknown LoRA op {m.op!r} (one of {', '.join(sorted(_LORA_OPS))})"
    return "" if m.instance_id else "a LoRA result without instance_id"


def token_logprobs_error(lp: TokenLogprobs | None, num_tokens: int | None = None) -> str:
    """Why logprobs ``lp`` are malformed ("" when they are not): top lists one per entry (or
    none at all) with as many ids as logprobs, and ``num_tokens`` entries when given."""
    if lp is None:
        return ""
    n = len(lp.token_logprobs)
    if num_tokens is not None and n != num_tokens:
        return f"{n} logprobs for {num_tokens} tokens"
    if len(lp.top_token_ids) != len(lp.top_logprobs) or lp.top_token_ids and \
            len(lp.top_token_ids) != n:
        return (f"{len(lp.top_token_ids)} top token lists and {len(lp.top_logprobs)} top "
                f"logprob lists for {n} entries")
    if any(len(a) != len(b) for a, b in zip(lp.top_token_ids, lp.top_logprobs)):
        return "a top token list and its logprobs differ in length"
    if lp.ranks and len(lp.ranks) != n:
        return f"{len(lp.ranks)} ranks for {n} entries"
    return ""


def check_token_stream(m: TokenStream) -> str:
    """Why ``m``'s logprobs are malformed: one per token of the delta ("" when fine)."""
    return token_logprobs_error(m.logprobs, len(m.token_ids)) or \
        token_logprobs_error(m.prompt_logprobs)


def check_prefill_done(m: PrefillDone) -> str:
    """Why ``m``'s logprobs are malformed: one for the first token ("" when fine)."""
    return token_logprobs_error(m.logprobs, 1) or token_logprobs_error(m.prompt_logprobs)


_FLOAT_DTYPES = frozenset({"float64", "float32", "bfloat16", "float16"})


def draft_seed_error(seed: DraftSeed, vocab_size: int | None = None,
                     position: int | None = None, token_id: int | None = None) -> str:
    """Why draft seed ``seed`` is malformed ("" when it is not): top-k lists of different
    lengths, empty or longer than MAX_DRAFT_SEED_TOPK, ids outside ``[0, vocab_size)`` (when
    given) or repeated, probabilities outside [0, 1] (NaN included) or not likeliest first,
    ``draft_hidden`` not a floating ``[1, d]`` matrix, ``draft_kv`` not a ``[layers, 2, heads,
    1, head_dim]`` array of its dtype, and a ``position`` / ``token_id`` other than the
    receiver's (when given: ``prompt_len - 1`` and the first token). Pure Python: the values
    inside the buffers are the drafter's to check (drafter/eagle/prefill_seed.py)."""
    ids, probs = seed.topk_ids, seed.topk_probs
    if len(ids) != len(probs):
        return f"{len(ids)} top-k ids and {len(probs)} probabilities"
    if not 1 <= len(ids) <= MAX_DRAFT_SEED_TOPK:
        return f"{len(ids)} top-k entries (want 1 .. {MAX_DRAFT_SEED_TOPK})"
    hi = vocab_size if vocab_size is not None else float("inf")
    if any(type(t) is not int or not 0 <= t < hi for t in [*ids, seed.token_id]):
        return f"a token id outside [0, {vocab_size})"
    if len(set(ids)) != len(ids):
        return "repeated top-k ids"
    if not all(0.0 <= q <= 1.0 for q in probs):  # NaN fails too
        return "top-k probabilities outside [0, 1]"
    if any(a < b for a, b in zip(probs, probs[1:])):
        return "top-k probabilities not likeliest first"
    h, kv = seed.draft_hidden, seed.draft_kv
    if h.dtype not in _FLOAT_DTYPES or len(h.shape) != 2 or h.shape[0] != 1 or not h.shape[1]:
        return f"draft_hidden {h.dtype}{list(h.shape)}: want a floating [1, d]"
    if kv.dtype != h.dtype or len(kv.shape) != 5 or kv.shape[1] != 2 or kv.shape[3] != 1 \
            or not all(kv.shape):
        return (f"draft_kv {kv.dtype}{list(kv.shape)}: want {h.dtype} [layers, 2, heads, 1, "
                "head_dim]")
    if position is not None and seed.position != position:
        return f"position {seed.position}, the request's last prompt position is {position}"
    if token_id is not None and seed.token_id != token_id:
        return f"token {seed.token_id}, the request's first token is {token_id}"
    return ""


#: message class -> check of the decoded message returning an error ("" when valid)
CROSS_FIELD_CHECKS: dict[type, Callable[[Any], str]] = {
    DraftTailStream: check_draft_tail,
    DraftBranches: check_draft_branches,
    DrafterCorpus: check_drafter_corpus,
    DrafterCorpusRelayed: check_corpus_relayed,
    DrafterCorpusResult: check_corpus_result,
    LoraAdapterOp: check_lora_op,
    LoraAdapterResult: check_lora_result,
    TokenStream: check_token_stream,
    PrefillDone: check_prefill_done,
}
