"""Wire messages of specmesh: frozen msgspec Structs with integer wire tags (docs/architecture.md,
'Messages').

Glossary (used everywhere in the code base):
- output positions are 0-based indices into a request's *output* tokens; the first token
  (sampled by the prefill worker) sits at output position 0.
- ``committed_len``: number of output tokens the verifier has committed; never rolled back.
- ``num_speculative_tokens`` (kappa, a setting, vLLM's name): the most drafts verified per
  request per step; 0 turns speculation off.
- ``num_draft_tokens``: a count of drafts (verified, sent, ...), never a setting.
- ``accept_len``: accepted drafts of one verify step, excluding the bonus / recovered token.
- ``block_table``: KV block ids of one request, in position order.

Every message subclasses :class:`Message` (a ``msgspec.Struct``: frozen, keyword-only, unknown
fields refused on decoding) with ``tag=<int>`` and is added to :data:`REGISTRY` by
:func:`register`. The type hints are the wire schema: protocol/codec.py decodes through them in C
(msgspec), so a field annotated ``NonNegInt`` refuses -1 on the wire. Constructing a message
locally checks nothing (msgspec validates on decoding only). Tags are never reused. Field types
are limited to int, float, str, bytes, bool, None, lists of those, nested registered messages and
:class:`Buffer` (an out-of-band binary frame); bounds are ``msgspec.Meta`` annotations. Copy with
a change: ``msgspec.structs.replace(msg, field=value)``; field names:
``msgspec.structs.fields(cls)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

# 2: num_speculative_tokens, block_table, role "verifier"; 3: Abort.num_output_tokens, field ranges;
# 4: SamplingParams.min_p (sampled and seeded requests); 5: TokenStream.offset;
# 6: HelloAck carries the acceptor's identity (protocol version, model, draft method);
# 7: DraftBranches (drafter -> verifier); 8: msgspec header (a map with a "tag" key, nested
# messages inline, absent fields with a default take it)
# 9: TokenStream loses synthetic_acceptance (the gateway flags synthetic acceptance from the
# cluster's configuration)
# 10: ModelIdentity.kv_cache_dtype
# 11: OpenAI Predicted Outputs: GenerateRequest / DraftSync.prediction_token_ids,
# DraftTailStream.from_prediction, TokenStream.num_{accepted,rejected}_prediction_tokens
# 12: DrafterCorpus, DrafterCorpusRelayed, DrafterCorpusResult (corpora and the drafters'
# cross-request history, controlled at run time)
# 13: logprobs: SamplingParams.logprobs / prompt_logprobs, TokenLogprobs, PrefillDone.logprobs /
# prompt_logprobs, TokenStream.logprobs / prompt_logprobs; SamplingParams penalties and token
# constraints (frequency / presence / repetition penalties, logit bias, min_tokens, bad words,
# allowed token ids, the verifier's EOS ids); the n choices of a prompt: GenerateRequest.group /
# group_size, PrefillRequest.sibling_sampling, PrefillDone.sibling_first_token_ids /
# sibling_logprobs; GrammarSpec,
# SamplingParams.grammar (structured output: response_format, guided_*, tools)
# 14: LoRA adapters: ModelIdentity.lora_adapters, GenerateRequest / PrefillRequest.lora_name
# 15: PrefillDone.num_cached_tokens, TokenStream.num_cached_tokens (prefix cache hits)
# 16: DraftTailStream.draft_confidences (a confidence head's survival predictions) and
# draft_token_probs (each greedy draft's probability), read by the confidence budget
# (decode/confidence_budget.py)
# 17: LoraAdapterOp, LoraAdapterResult (LoRA adapters loaded / unloaded at run time)
# 18: DraftTailStream trees may carry draft_probs (sampled EAGLE-2 trees: a row per node);
# verifiers before 18 refuse them
# 19: VerifyCommit.drafting_paused (the verifier's speculation gate, decode/speculation_gate.py)
# 20: SharedKVPool (Hello.shared_kv: the verifier's KV pool in shared memory, for a frozen-KV
# MTP drafter on its node) and TargetKVRows (DraftSync / VerifyCommit.target_kv: a request's
# committed rows in it)
# 21: DraftSeed (PrefillDone / DraftSync.draft_seed: the EAGLE head's first draft step run at
# the prefill, SGLang's P/D EAGLE seed: top-k ids and probabilities, head state and head K/V)
PROTOCOL_VERSION = 21
PLACEHOLDER_TOKEN_ID = -1
#: most top-k entries a DraftSeed carries (SGLang's MetadataBuffers hold 16 per request)
MAX_DRAFT_SEED_TOPK = 16
#: most top logprobs a request may ask per position (vLLM's default ``max_logprobs``, OpenAI's
#: ``top_logprobs`` limit)
MAX_LOGPROBS = 20


#: a count, length or output position (never negative)
NonNegInt = Annotated[int, Meta(ge=0)]
#: a count that is at least one
PositiveInt = Annotated[int, Meta(ge=1)]
#: a token id (vocabulary bounds are the receiver's to check: the wire layer has no vocabulary)
TokenId = Annotated[int, Meta(ge=0)]


class _Registry(dict):
    """tag -> message class, with a ``version`` bumped on every change so the codec knows when
    to rebuild its decoders (tests register and unregister messages of their own)."""

    version = 0

    def __setitem__(self, tag: int, cls: type) -> None:
        super().__setitem__(tag, cls)
        self.version += 1

    def __delitem__(self, tag: int) -> None:
        super().__delitem__(tag)
        self.version += 1

    def pop(self, *args: Any) -> Any:
        self.version += 1
        return super().pop(*args)

    def _frozen(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("REGISTRY changes one tag at a time (register / item assignment / del)")

    update = setdefault = popitem = clear = _frozen


#: tag -> message class; filled by :func:`register`.
REGISTRY: _Registry = _Registry()

# dtype names a Buffer may carry, with their item size in bytes (no torch import here).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True,
              tag_field="tag"):
    """Base of every wire message: a frozen Struct that refuses unknown fields on decoding,
    declared ``class X(Message, tag=<int>, kw_only=True)``: ``tag`` is its wire tag (the
    ``"tag"`` key of its header map; ``TAG`` repeats it once :func:`register` has run), and
    ``kw_only`` must be repeated because msgspec does not inherit it."""

    TAG: ClassVar[int]


def register(cls: type) -> type:
    """Class decorator: add :class:`Message` subclass ``cls`` to :data:`REGISTRY` under its
    struct tag and set ``cls.TAG``.

    Raises:
        TypeError: ``cls`` is not a Message subclass with an int tag and keyword-only fields.
        ValueError: the tag is already taken by another class.
    """
    tag = getattr(getattr(cls, "__struct_config__", None), "tag", None)
    if not (isinstance(cls, type) and issubclass(cls, Message)) or type(tag) is not int:
        raise TypeError(f"{getattr(cls, '__name__', cls)!r} is not a Message with an int tag")
    if any(p.kind is not p.KEYWORD_ONLY for p in inspect.signature(cls).parameters.values()):
        raise TypeError(f"{cls.__name__}: declare it with kw_only=True")
    if tag in REGISTRY and REGISTRY[tag].__name__ != cls.__name__:
        raise ValueError(f"wire tag {tag} already used by {REGISTRY[tag].__name__}")
    cls.TAG = tag
    REGISTRY[tag] = cls
    return cls


def buffer_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a C-order array of ``shape`` and ``dtype``: ``prod(shape) * itemsize(dtype)``
    (the one copy of this product: the codec, the frames and ``Buffer.nbytes`` use it).

    Raises:
        ValueError: ``dtype`` is not in :data:`DTYPE_ITEMSIZE`, or a dimension is not a
            non-negative int.
    """
    itemsize = DTYPE_ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise ValueError(f"unknown buffer dtype {dtype!r}")
    n = itemsize
    for s in shape:
        if type(s) is not int or s < 0:
            raise ValueError(f"bad buffer shape {list(shape)!r}: dimensions must be ints >= 0")
        n *= s
    return n


class Buffer:
    """A binary buffer that travels as its own ZMQ frame (immutable).

    ``data`` holds ``prod(shape) * itemsize(dtype)`` bytes in C order. ``dtype`` is a name from
    :data:`DTYPE_ITEMSIZE` (``"bfloat16"`` included: protocol/ never touches numpy or torch).
    A plain class on purpose, not a Struct or dataclass: msgspec then hands it to the codec's
    hooks, which put ``data`` in a frame of its own and a reference in the header.
    """

    __slots__ = ("dtype", "shape", "data")
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __init__(self, dtype: str, shape: Sequence[int], data: bytes | memoryview) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "data", data)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Buffer is immutable (cannot set {name!r})")

    __delattr__ = __setattr__

    def __reduce__(self) -> tuple:
        return (Buffer, (self.dtype, self.shape, self.data))

    def __repr__(self) -> str:
        return f"Buffer(dtype={self.dtype!r}, shape={self.shape!r}, data=<{len(self.data)}>)"

    @property
    def nbytes(self) -> int:
        """``prod(shape) * itemsize(dtype)``, bytes (see :func:`buffer_nbytes`)."""
        return buffer_nbytes(self.dtype, self.shape)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Buffer)
            and self.dtype == other.dtype
            and tuple(self.shape) == tuple(other.shape)
            and bytes(self.data) == bytes(other.data)
        )

    def __hash__(self) -> int:
        return hash((self.dtype, tuple(self.shape), len(self.data)))


# --------------------------------------------------------------------------------------------
# Shared parts
# --------------------------------------------------------------------------------------------


@register
class ModelIdentity(Message, tag=1, kw_only=True):
    """What two peers must agree on before exchanging KV or tokens.

    ``kv_cache_dtype``: the dtype of the KV cache and so of every KVFrame (``--kv-cache-dtype``
    resolved: never ``auto``; the model's ``dtype`` unless a float32 model keeps a 16-bit
    cache). Prefill and verifier must hold the same one, since the verifier writes the frames'
    K/V as they are and re-derives nothing from them; so every role announces it.

    ``lora_adapters``: the LoRA adapters a prefill worker or verifier serves (engine/lora.py:
    ``name@digest`` of each, sorted, comma-separated; "" none). Prefill and verifier must serve
    the same set, since an adapter's prompt KV is the adapter's; drafters (which draft from the
    base) and the gateway announce "" and it is not compared on their channels
    (protocol/handshake.py).
    """

    name: str
    vocab_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_cache_dtype: str
    lora_adapters: str = ""

    @classmethod
    def example(cls) -> ModelIdentity:
        return cls(name="SmolLM2-135M-Instruct", vocab_size=49152, dtype="float32",
                   num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                   kv_cache_dtype="float32")


@register
class GrammarSpec(Message, tag=3, kw_only=True):
    """A request's structured-output constraint, normalized by the gateway (vLLM's
    ``structured_outputs`` / ``guided_*`` and OpenAI's ``response_format`` and forced tool
    calls all become one of these; engine/grammar.py compiles it).

    ``kind``: ``"json_schema"`` (``value``: the schema as JSON text; OpenAI's ``json_object``
    is the schema ``{"type": "object"}``), ``"regex"`` (``value``: the pattern, matched whole),
    ``"lark"`` (``value``: a Lark grammar, llguidance's dialect; ``guided_choice`` and GBNF
    grammars arrive converted to it). Every output token is then drawn under the grammar's
    token mask, and the request ends (finish reason ``stop``) when the grammar is complete.
    """

    kind: str
    value: str

    @classmethod
    def example(cls) -> GrammarSpec:
        return cls(kind="json_schema", value='{"type": "object"}')


@register
class SamplingParams(Message, tag=2, kw_only=True):
    """Per-request sampling (vLLM's semantics, kernels/logits_processing.py): ``temperature``
    below 1e-5 is greedy (top-p/k and min-p then ignored); ``top_k <= 0`` (or ``>= vocab``),
    ``top_p == 1`` and ``min_p == 0`` are off. ``seed`` set on a sampled request selects the
    coupled rule (docs/architecture.md, 'Verification rules'): its output is a function of
    (prompt, parameters, seed) alone, the same with speculation on or off. ``max_tokens``
    counts output tokens."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    # --- logprobs (issue 33): None = not asked (nobody pays for them); k >= 0: the chosen
    # token's logprob plus the k most likely tokens' at every output position (``logprobs``)
    # / at every prompt position after the first (``prompt_logprobs``, from the prefill role)
    logprobs: NonNegInt | None = None
    prompt_logprobs: NonNegInt | None = None
    # -- penalties and token constraints (vLLM's semantics; engine/logits_processors.py applies
    # them at every verified position with the tokens committed before it; neutral defaults)
    #: subtracted once from the logit of every token in the output so far (OpenAI, [-2, 2])
    presence_penalty: float = 0.0
    #: times the token's count in the output so far, subtracted from its logit ([-2, 2])
    frequency_penalty: float = 0.0
    #: tokens of prompt + output: positive logits divided by it, negative ones multiplied
    #: (vLLM / CTRL, > 0; 1 is off)
    repetition_penalty: float = 1.0
    #: OpenAI logit_bias as two aligned lists (a wire-friendly map): the bias
    #: ``logit_bias_values[i]`` ([-100, 100]) is added to token ``logit_bias_token_ids[i]``
    logit_bias_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    logit_bias_values: list[float] = msgspec.field(default_factory=list)
    #: EOS and stop_token_ids are masked until this many output tokens exist (vLLM)
    min_tokens: NonNegInt = 0
    #: vLLM bad_words, tokenized by the gateway: a word's last token is masked when the
    #: output so far ends with the word's other tokens
    bad_words_token_ids: list[list[TokenId]] = msgspec.field(default_factory=list)
    #: vLLM allowed_token_ids: only these may be sampled (None: every token)
    allowed_token_ids: list[TokenId] | None = None
    #: the deployment's EOS ids, filled in by the verifier at admission (the gateway leaves it
    #: empty) so that every role masks them for ``min_tokens`` (unless ``ignore_eos``)
    eos_token_ids: list[TokenId] = msgspec.field(default_factory=list)
    #: structured output (None: unconstrained); see GrammarSpec
    grammar: GrammarSpec | None = None

    def invalid_reason(self) -> str:
        """Why these parameters can never be sampled ("" when they can): a temperature that is
        negative or not finite, ``top_p`` outside ``(0, 1]``, ``min_p`` outside ``[0, 1]``, a
        ``top_k`` beyond int64, a seed outside ``[-2**63, 2**64)``. Pure Python (the scheduler
        and the prefill worker call it)."""
        t = self.temperature
        if not (t >= 0 and t != float("inf")):  # also refuses NaN
            return f"temperature must be finite and >= 0, got {t!r}"
        if not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if not 0 <= self.min_p <= 1:
            return f"min_p must be in [0, 1], got {self.min_p!r}"
        if not -(1 << 63) <= self.top_k < 1 << 63:
            return f"top_k must be a 64-bit signed integer, got {self.top_k}"
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            return f"seed must be in [-2**63, 2**64), got {self.seed}"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                return f"{name} must be in [0, {MAX_LOGPROBS}], got {k}"
        return self.penalty_invalid_reason()

    def penalty_invalid_reason(self) -> str:
        """Why the penalties and token constraints can never be applied ("" when they can):
        presence / frequency penalties outside ``[-2, 2]`` (OpenAI's range), a repetition
        penalty not finite and ``> 0`` (vLLM's), logit bias lists of different lengths or a value
        outside ``[-100, 100]``, ``min_tokens`` above ``max_tokens``, an empty bad word, an
        empty ``allowed_token_ids``. Token ids against the vocabulary: :meth:`vocab_reason`."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:  # also refuses NaN
                return f"{name} must be in [-2, 2], got {v!r}"
        if not 0.0 < self.repetition_penalty < float("inf"):
            return f"repetition_penalty must be finite and > 0, got {self.repetition_penalty!r}"
        if len(self.logit_bias_token_ids) != len(self.logit_bias_values):
            return (f"logit_bias has {len(self.logit_bias_token_ids)} token ids and "
                    f"{len(self.logit_bias_values)} values")
        if any(not -100.0 <= v <= 100.0 for v in self.logit_bias_values):
            return "logit_bias values must be in [-100, 100]"
        if self.min_tokens > self.max_tokens:
            return f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
        if any(not w for w in self.bad_words_token_ids):
            return "bad_words must not hold an empty word"
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            return "allowed_token_ids must not be empty"
        return ""

    def vocab_reason(self, vocab_size: int) -> str:
        """Why a token id of the penalties and constraints lies outside ``[0, vocab_size)``
        ("" when none does); the receiver's check (the wire layer has no vocabulary)."""
        for name, ids in (("logit_bias", self.logit_bias_token_ids),
                          ("bad_words", [t for w in self.bad_words_token_ids for t in w]),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            if any(not 0 <= t < vocab_size for t in ids):
                return f"{name} token ids must lie in [0, {vocab_size})"
        return ""

    @property
    def has_logits_processors(self) -> bool:
        """Whether any penalty or token constraint is set (neutral values are none): requests
        without one skip the processing entirely."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias_token_ids
                    or self.min_tokens or self.bad_words_token_ids
                    or self.allowed_token_ids is not None)

    @classmethod
    def example(cls) -> SamplingParams:
        return cls(max_tokens=32, temperature=0.0, seed=7, stop_token_ids=[2, 5],
                   presence_penalty=0.5, logit_bias_token_ids=[3], logit_bias_values=[-1.5],
                   min_tokens=2, bad_words_token_ids=[[4, 6]], allowed_token_ids=[1, 3, 9],
                   eos_token_ids=[0])


# --------------------------------------------------------------------------------------------
# Handshake (any peer pair)
# --------------------------------------------------------------------------------------------


@register
class SharedKVPool(Message, tag=70, kw_only=True):
    """Where a verifier keeps its paged KV pool in shared memory, so that a drafter on the same
    node can map it read-only (a frozen-KV MTP assistant, drafter/proposers/frozen_kv_mtp.py,
    which owns no KV pool of its own; docs/drafters.md, 'Frozen-KV MTP').

    ``node``: the verifier's node identity (protocol/colocation.py: host name and boot id);
    ``path``: the file that backs the pool; ``device`` / ``inode``: that file's identity
    (``os.stat``), so a drafter that sees another file under the same path refuses it;
    ``shape``: the pool tensor's ``[num_layers, 2, num_slots, num_kv_heads, head_dim]``
    (engine/kv_cache.py), C order; ``dtype``: its element type (a name of
    :data:`DTYPE_ITEMSIZE`); ``block_size``: tokens per KV block (slot = block id *
    block_size + offset)."""

    node: str
    path: str
    device: NonNegInt
    inode: NonNegInt
    shape: list[NonNegInt]
    dtype: str
    block_size: PositiveInt

    @property
    def nbytes(self) -> int:
        """Bytes of the pool: the product of ``shape`` times the dtype's size."""
        return buffer_nbytes(self.dtype, tuple(self.shape))

    @classmethod
    def example(cls) -> SharedKVPool:
        return cls(node="host-a/6f1c", path="/dev/shm/specmesh-kv-verifier-0-1-42",
                   device=25, inode=1234, shape=[30, 2, 4096, 3, 64], dtype="bfloat16",
                   block_size=16)


@register
class TargetKVRows(Message, tag=71, kw_only=True):
    """Verifier -> drafter, with DraftSync and VerifyCommit when the verifier shares its KV
    pool (:class:`SharedKVPool`): the request's ``block_table`` (enough blocks for
    ``num_rows`` positions) and ``num_rows``, the positions whose K/V the verifier has written
    and committed (prompt + committed output but the last token, ``Request.kv_len``). A drafter
    reads rows ``[0, num_rows)`` only: rows past it may hold rejected drafts, and blocks of a
    request the verifier finished (DraftClose) belong to another request next."""

    block_table: list[NonNegInt]
    num_rows: NonNegInt

    @classmethod
    def example(cls) -> TargetKVRows:
        return cls(block_table=[4, 9], num_rows=20)


@register
class DraftSeed(Message, tag=72, kw_only=True):
    """The draft head's first step, run by the prefill worker after the prompt (EAGLE family,
    docs/drafters.md 'The seed across P/D'): what SGLang's P/D EAGLE ships per request
    (``output_topk_p`` / ``output_topk_index`` and the draft's hidden state in
    ``disaggregation/utils.py`` MetadataBuffers, plus the draft KV), so the drafter's first
    round recomputes nothing. Prefill -> verifier in PrefillDone, verifier -> drafter in the
    request's first DraftSync.

    ``position``: the head entry's context position (``p - 1`` for a ``p``-token prompt; it
    read the target's seed state there); ``token_id``: the token that entry read (output
    position 0, the prefill's first token); ``topk_ids``: target-vocabulary ids of the entry's
    draft distribution's top k, likeliest first (1 .. :data:`MAX_DRAFT_SEED_TOPK`);
    ``topk_probs``: their probabilities under the head (float); ``draft_hidden``: the head's
    output state of the entry, ``[1, d]`` in the head's dtype (what the next draft step reads);
    ``draft_kv``: the entry's keys and values in the head's layout, ``[num_layers, 2,
    num_kv_heads, 1, head_dim]`` (0 keys, 1 values), same dtype (module 0 of a multi-layer
    head).

    Not checked by the codec: a malformed seed must not fail its PrefillDone or DraftSync.
    Receivers check it (protocol/cross_checks.py ``draft_seed_error``, the drafter its shapes
    against its head) and ignore one that does not fit, drafting without it.
    """

    position: int
    token_id: int
    topk_ids: list[int]
    topk_probs: list[float]
    draft_hidden: Buffer
    draft_kv: Buffer

    @property
    def nbytes(self) -> int:
        """Payload bytes: both buffers plus 8 per top-k id and probability (msgpack int64 /
        float64)."""
        return self.draft_hidden.nbytes + self.draft_kv.nbytes + 8 * (
            len(self.topk_ids) + len(self.topk_probs))

    @classmethod
    def example(cls) -> DraftSeed:
        return cls(position=2, token_id=42, topk_ids=[42, 7], topk_probs=[0.75, 0.125],
                   draft_hidden=Buffer("float32", (1, 4), bytes(16)),
                   draft_kv=Buffer("float32", (1, 2, 1, 1, 2), bytes(16)))


@register
class Hello(Message, tag=10, kw_only=True):
    """First message on every connection, repeated after a reconnect. ``shared_kv``: a
    verifier that keeps its KV pool in shared memory says where (:class:`SharedKVPool`; a
    drafter whose method reads it refuses a Hello without one, or from another node)."""

    protocol_version: int
    role: str  # a protocol.enums.Role value: prefill | verifier | drafter | gateway
    instance_id: str
    incarnation: int  # a restarted process has a new one
    model: ModelIdentity | None = None
    draft_method: str = ""
    shared_kv: SharedKVPool | None = None

    @classmethod
    def example(cls) -> Hello:
        return cls(protocol_version=PROTOCOL_VERSION, role="drafter", instance_id="drafter-0",
                   incarnation=3, model=ModelIdentity.example(), draft_method="ngram")


@register
class HelloAck(Message, tag=11, kw_only=True):
    """Answer to :class:`Hello`; ``accepted=False`` carries the reason in ``error``.

    Carries the acceptor's own identity (the fields of a Hello), which the initiator compares
    with its own as the acceptor compared the Hello (protocol/handshake.py): both sides check.
    """

    accepted: bool
    protocol_version: int
    role: str
    instance_id: str
    incarnation: int
    model: ModelIdentity | None = None
    draft_method: str = ""
    error: str = ""

    @classmethod
    def example(cls) -> HelloAck:
        return cls(accepted=False, protocol_version=PROTOCOL_VERSION, role="verifier",
                   instance_id="verifier-0", incarnation=1, model=ModelIdentity.example(),
                   draft_method="ngram", error="model mismatch: vocab_size 49152 != 32000")


@register
class TokenLogprobs(Message, tag=23, kw_only=True):
    """Log probabilities of consecutive tokens (output or prompt positions), one entry each.

    ``token_logprobs[i]``: the log probability of the token at position i under the target's
    distribution there (float32 ``log_softmax`` of the logits the verification rule saw, before
    temperature / top-k / top-p: vLLM's default, raw-model logprobs); ``top_token_ids[i]`` and
    ``top_logprobs[i]``: the request's k most likely tokens there, most likely first (empty
    lists when k = 0). ``ranks[i]``: the token's rank there (1 = the most likely; vLLM's
    ``rank``). A masked-out token has ``-inf``.
    """

    token_logprobs: list[float]
    top_token_ids: list[list[TokenId]] = msgspec.field(default_factory=list)
    top_logprobs: list[list[float]] = msgspec.field(default_factory=list)
    ranks: list[NonNegInt] = msgspec.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def slice(self, start: int, stop: int | None = None) -> TokenLogprobs:
        """Entries ``[start, stop)``."""
        return TokenLogprobs(token_logprobs=self.token_logprobs[start:stop],
                             top_token_ids=self.top_token_ids[start:stop],
                             top_logprobs=self.top_logprobs[start:stop],
                             ranks=self.ranks[start:stop])

    @staticmethod
    def concat(parts: Sequence[TokenLogprobs]) -> TokenLogprobs:
        """The entries of ``parts`` back to back."""
        return TokenLogprobs(token_logprobs=[x for p in parts for x in p.token_logprobs],
                             top_token_ids=[x for p in parts for x in p.top_token_ids],
                             top_logprobs=[x for p in parts for x in p.top_logprobs],
                             ranks=[x for p in parts for x in p.ranks])

    @classmethod
    def example(cls) -> TokenLogprobs:
        return cls(token_logprobs=[-0.25, -1.5], top_token_ids=[[9, 4], [3, 10]],
                   top_logprobs=[[-0.25, -2.0], [-0.75, -1.5]], ranks=[1, 2])


# --------------------------------------------------------------------------------------------
# Gateway <-> verifier
# --------------------------------------------------------------------------------------------


@register
class GenerateRequest(Message, tag=20, kw_only=True):
    """Gateway -> verifier: generate for an already tokenized prompt.

    ``prediction_token_ids`` (OpenAI Predicted Outputs): the client's predicted output,
    tokenized without a chat template; the verifier forwards it to the drafter, which drafts
    from it first (drafter/prediction.py). None: no prediction.

    ``group`` / ``group_size`` (OpenAI's ``n``, vLLM's ``best_of``): the gateway sends each of
    a prompt's ``group_size`` choices as its own request with the same ``group`` (and the same
    prompt), all to one verifier; the verifier prefills the prompt once and forks the others
    from the first one's KV (decode/siblings.py). ``group`` empty: a request of its own.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    num_speculative_tokens: int | None = None  # this request's kappa; None = the verifier's
    prediction_token_ids: list[TokenId] | None = None
    group: str = ""
    group_size: PositiveInt = 1
    #: the LoRA adapter the request runs with (``model: name`` of the API; "" the base model)
    lora_name: str = ""

    @classmethod
    def example(cls) -> GenerateRequest:
        return cls(request_id="req-1", prompt_token_ids=[1, 2, 3, 4],
                   sampling=SamplingParams.example(), num_speculative_tokens=4,
                   prediction_token_ids=[5, 6, 7], group="cmpl-1", group_size=2)


@register
class TokenStream(Message, tag=21, kw_only=True):
    """Verifier -> gateway: newly committed output tokens (a delta) plus running spec stats.

    ``finish_reason`` is ``"stop"`` (EOS / stop token), ``"length"`` (max_tokens), ``"abort"`` or
    ``"error"`` (then ``error`` says why) once ``finished`` is true.

    ``offset``: the output position of the first token of ``token_ids`` (the number of output
    tokens the verifier streamed before this delta), so the gateway sees a lost or repeated
    delta (a gap or an overlap) and fails the request rather than return text with a hole.

    ``num_accepted_prediction_tokens`` / ``num_rejected_prediction_tokens`` (a request with a
    prediction): of the drafts verified so far, those drafted from the prediction that the
    verifier accepted / rejected (cumulative, cut at the end of the output like the spec stats).
    """

    request_id: str
    token_ids: list[TokenId]
    offset: NonNegInt = 0
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: NonNegInt = 0
    num_draft_tokens: NonNegInt = 0  # drafts verified so far for this request
    num_accepted_tokens: NonNegInt = 0  # of which accepted
    num_verify_steps: NonNegInt = 0  # verify forwards that included drafts
    error: str = ""
    num_accepted_prediction_tokens: NonNegInt = 0
    num_rejected_prediction_tokens: NonNegInt = 0
    #: prompt tokens the prefill took from its prefix cache (PrefillDone.num_cached_tokens)
    num_cached_tokens: NonNegInt = 0
    #: one entry per token of ``token_ids`` when the request asked (SamplingParams.logprobs)
    logprobs: TokenLogprobs | None = None
    #: the prompt's logprobs (positions 1 .. n-1), on the delta at offset 0, when asked
    prompt_logprobs: TokenLogprobs | None = None

    @classmethod
    def example(cls) -> TokenStream:
        return cls(request_id="req-1", token_ids=[9, 10], offset=3, finished=True,
                   finish_reason="length",
                   num_prompt_tokens=4, num_draft_tokens=6, num_accepted_tokens=3,
                   num_verify_steps=2, num_accepted_prediction_tokens=2,
                   num_rejected_prediction_tokens=1, logprobs=TokenLogprobs.example())


@register
class Abort(Message, tag=22, kw_only=True):
    """Gateway -> verifier (client gone, stop string hit) or verifier -> prefill.

    ``num_output_tokens``: the output tokens the client kept when a stop string ended the
    output (the token that completed the stop string included); the verifier counts usage and
    spec stats only up to there (docs/architecture.md, 'The verify step': nothing past the cut
    is counted). None: the request is dropped where it stands (client gone).
    """

    request_id: str
    reason: str = "abort"
    num_output_tokens: NonNegInt | None = None

    @classmethod
    def example(cls) -> Abort:
        return cls(request_id="req-1", reason="stop string", num_output_tokens=7)


# --------------------------------------------------------------------------------------------
# Verifier <-> prefill (KV transfer)
# --------------------------------------------------------------------------------------------


@register
class PrefillRequest(Message, tag=30, kw_only=True):
    """Verifier -> prefill: run the prompt and ship its KV into ``block_table`` of the verifier
    (the channel the request came on carries the KV back)."""

    request_id: str
    transfer_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_table: list[int]  # destination KV blocks on the verifier, in position order
    draft_method: str = ""  # decides which seed state PrefillDone carries (drafter issue)
    #: the verifier shares its CPU cores with this prefill worker and computes nothing while
    #: this prompt runs (it pauses its verify steps for prefills in flight, or has nothing to
    #: do): the prefill worker may then run the prompt on them all (cluster/hosts/prefill.py)
    verifier_idle: bool = False
    #: the sampling of each sibling of this request (same prompt, decode/siblings.py) whose
    #: first token the prefill worker samples from the same last-position logits
    sibling_sampling: list[SamplingParams] | None = None
    #: the LoRA adapter the prompt runs with (GenerateRequest.lora_name; "" the base model)
    lora_name: str = ""

    @classmethod
    def example(cls) -> PrefillRequest:
        return cls(request_id="req-1", transfer_id=11, prompt_token_ids=[1, 2, 3],
                   sampling=SamplingParams.example(), block_table=[4, 7],
                   draft_method="ngram", sibling_sampling=[SamplingParams.example()])


@register
class KVFrame(Message, tag=31, kw_only=True):
    """Prefill -> verifier: KV of prompt tokens ``[token_start, token_start + num_tokens)`` for
    layers ``[layer_start, layer_end)``.

    ``kv`` has shape ``[layer_end - layer_start, 2, num_tokens, num_kv_heads, head_dim]``
    (index 0 = keys, 1 = values) in the KV cache dtype (``ModelIdentity.kv_cache_dtype``: the
    model dtype, or bfloat16 / float16 for a float32 model with a 16-bit cache).
    """

    request_id: str
    transfer_id: int
    layer_start: int
    layer_end: int
    chunk_index: int
    token_start: int
    num_tokens: int
    kv: Buffer

    @classmethod
    def example(cls) -> KVFrame:
        shape = (2, 2, 3, 1, 4)  # [layers, k/v, tokens, kv_heads, head_dim]
        data = bytes(i % 251 for i in range(2 * 2 * 3 * 1 * 4 * 4))
        return cls(request_id="req-1", transfer_id=11, layer_start=0, layer_end=2, chunk_index=0,
                   token_start=0, num_tokens=3, kv=Buffer("float32", shape, data))


@register
class PrefillDone(Message, tag=32, kw_only=True):
    """Prefill -> verifier: the prompt ran; ``first_token_id`` is output position 0.

    The transfer is complete when ``num_frames`` KVFrames with ``num_bytes`` bytes of KV in all
    have arrived for ``transfer_id`` (in either order relative to this message). ``seed_state``
    is the draft method's seed (EAGLE: hidden state at the last prompt position), or None.
    ``error`` non-empty means the prefill failed and no KV follows.
    """

    request_id: str
    transfer_id: int
    first_token_id: int
    num_frames: int
    num_bytes: int
    seed_state: Buffer | None = None
    error: str = ""
    #: the first token's logprobs (one entry) when its request asked (SamplingParams.logprobs)
    logprobs: TokenLogprobs | None = None
    #: the prompt's logprobs, positions 1 .. n-1 (position 0 has none), when asked
    #: (SamplingParams.prompt_logprobs)
    prompt_logprobs: TokenLogprobs | None = None
    #: output position 0 of each sibling, in PrefillRequest.sibling_sampling's order, and its
    #: logprobs (one entry each) when any sibling asked
    sibling_first_token_ids: list[TokenId] | None = None
    sibling_logprobs: list[TokenLogprobs] | None = None
    #: prompt tokens whose KV came from the prefill's prefix cache (not computed): its
    #: leading full blocks; OpenAI's ``usage.prompt_tokens_details.cached_tokens``
    num_cached_tokens: int = 0
    #: the draft head's first step over the prompt (EAGLE family, :class:`DraftSeed`), when
    #: the prefill runs it for the request's draft method (``--prefill-draft-seed``)
    draft_seed: DraftSeed | None = None

    @classmethod
    def example(cls) -> PrefillDone:
        return cls(request_id="req-1", transfer_id=11, first_token_id=42, num_frames=2,
                   num_bytes=384, seed_state=Buffer("bfloat16", (1, 4), bytes(8)),
                   logprobs=TokenLogprobs.example().slice(0, 1),
                   prompt_logprobs=TokenLogprobs.example(), sibling_first_token_ids=[7],
                   sibling_logprobs=[TokenLogprobs.example().slice(0, 1)])


@register
class PrefillCancel(Message, tag=33, kw_only=True):
    """Verifier -> prefill: stop a transfer; blocks stay reserved until
    :class:`PrefillCancelAck`."""

    request_id: str
    transfer_id: int

    @classmethod
    def example(cls) -> PrefillCancel:
        return cls(request_id="req-1", transfer_id=11)


@register
class PrefillCancelAck(Message, tag=34, kw_only=True):
    """Prefill -> verifier: no frame of ``transfer_id`` will be sent after this message."""

    request_id: str
    transfer_id: int

    @classmethod
    def example(cls) -> PrefillCancelAck:
        return cls(request_id="req-1", transfer_id=11)


# --------------------------------------------------------------------------------------------
# Verifier <-> drafter
# --------------------------------------------------------------------------------------------


@register
class DraftSync(Message, tag=40, kw_only=True):
    """Verifier -> drafter: open or re-open a request; the committed prefix is the truth.
    ``prediction_token_ids``: the request's prediction (GenerateRequest's), drafted from
    first; None: none."""

    request_id: str
    prompt_token_ids: list[int]
    committed_token_ids: list[int]
    sampling: SamplingParams
    seed_state: Buffer | None = None
    prediction_token_ids: list[TokenId] | None = None
    target_kv: TargetKVRows | None = None  # a verifier that shares its KV pool (Hello.shared_kv)
    #: the prefill's draft seed (:class:`DraftSeed`), on a request's first DraftSync only,
    #: while the committed output is just the first token (a later one would be stale)
    draft_seed: DraftSeed | None = None

    @classmethod
    def example(cls) -> DraftSync:
        return cls(request_id="req-1", prompt_token_ids=[1, 2, 3], committed_token_ids=[42],
                   sampling=SamplingParams.example(), prediction_token_ids=[42, 7, 8])


@register
class VerifyCommit(Message, tag=41, kw_only=True):
    """Verifier -> drafter: output tokens committed at positions
    ``[pre_commit_len, pre_commit_len + len(committed_token_ids))``.

    ``num_drafts_wanted``: the most drafts the verifier will verify for this request in its
    next steps (its kappa capped by the request's recent accept length and the step's goodput
    cap, decode/goodput.py); the drafter runs
    ahead by a multiple of it instead of a multiple of kappa, so drafts that would never be
    verified are not drafted. None: kappa. ``drafting_paused``: the verifier's steps verify
    none of the method's drafts for now (its speculation gate measured drafting as slower,
    decode/speculation_gate.py): draft nothing for this request (no probe, no branches) until
    a commit says otherwise; a prediction is still drafted from."""

    request_id: str
    pre_commit_len: int
    committed_token_ids: list[int]
    seed_state: Buffer | None = None  # EAGLE family: [accept_len + 1, hidden_size]
    num_drafts_wanted: NonNegInt | None = None
    drafting_paused: bool = False
    target_kv: TargetKVRows | None = None  # a verifier that shares its KV pool (Hello.shared_kv)

    @classmethod
    def example(cls) -> VerifyCommit:
        return cls(request_id="req-1", pre_commit_len=1, committed_token_ids=[5, 6, 7],
                   seed_state=Buffer("float32", (3, 2), bytes(24)), num_drafts_wanted=2)


@register
class DraftTailStream(Message, tag=42, kw_only=True):
    """Drafter -> verifier: draft tokens at output positions ``start_pos, start_pos + 1, ...``.

    A chain, or a tree when ``parents`` is given (index of each token's parent within this
    segment, -1 = the token before ``start_pos``; one per draft token). ``draft_probs``
    (``[n, vocab_size]``, n = number of drafts) only when the verification rule needs them;
    a tree's row j is the distribution node j was drawn from given its parent and its earlier
    siblings (a sampled EAGLE-2 tree, drafter/eagle/sampled_tree.py).
    ``base_committed_len`` is the committed length the drafter had seen when it drafted
    (``<= start_pos``): the segment continues the drafter's path at positions
    ``[base_committed_len, start_pos)``, which the verifier uses to see that a segment was
    drafted on a prefix it has since rejected (decode/tail_buffer.py).

    ``from_prediction``: every draft of the segment was copied from the request's prediction
    (OpenAI Predicted Outputs; the verifier counts their acceptance for the usage's
    ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``); a drafter splits its path
    into segments where the source changes. Such drafts are deterministic proposals: a
    prediction segment is a chain without ``draft_probs`` (verified one-hot, which keeps
    sampled requests exact).

    ``draft_confidences``: one per draft (or empty: none), the drafter's predicted probability
    that the draft is accepted given that the drafts before it were (a trained confidence
    head's output, DSpark's); the verifier's confidence budget uses them as sent
    (decode/confidence_budget.py, ``--speculative-policy confidence``); a drafter without a
    head sends none. ``draft_token_probs``: one per draft (or empty), the draft's probability
    under the drafter's distribution, for drafts sent without a ``draft_probs`` row (a model
    drafter's greedy drafts: the softmax of the logits it took the argmax of); the verifier
    calibrates it into a confidence from its own verify outcomes
    (decode/confidence_calibration.py).

    Decoding refuses (ProtocolError) negative positions or token ids, ``start_pos <
    base_committed_len``, parents of the wrong length or pointing outside the segment,
    ``draft_probs`` whose rows are not the drafts, a prediction segment with parents or
    ``draft_probs``, and ``draft_confidences`` or ``draft_token_probs`` not one per draft or
    outside [0, 1].
    """

    request_id: str
    base_committed_len: NonNegInt
    start_pos: NonNegInt
    draft_token_ids: list[TokenId]
    draft_probs: Buffer | None = None
    parents: list[int] | None = None
    from_prediction: bool = False
    draft_confidences: list[float] = []
    draft_token_probs: list[float] = []

    @classmethod
    def example(cls) -> DraftTailStream:
        return cls(request_id="req-1", base_committed_len=4, start_pos=4,
                   draft_token_ids=[8, 9, 10], parents=[-1, 0, 1])


@register
class DraftClose(Message, tag=43, kw_only=True):
    """Verifier -> drafter: the request ended (``finished`` | ``abort``); drop its state."""

    request_id: str
    reason: str = "finished"

    @classmethod
    def example(cls) -> DraftClose:
        return cls(request_id="req-1", reason="abort")


@register
class DraftNeedSync(Message, tag=44, kw_only=True):
    """Drafter -> verifier: the drafter lost alignment; answer with a fresh DraftSync."""

    request_id: str
    reason: str = ""

    @classmethod
    def example(cls) -> DraftNeedSync:
        return cls(request_id="req-1", reason="commit at 9 but drafter holds 4 tokens")


@register
class DraftBranches(Message, tag=45, kw_only=True):
    """Drafter -> verifier: drafts prepared for verification outcomes other than its path
    (the speculation cache of SSD / Saguaro, arXiv 2603.03251, kept at the verifier).

    "If you commit my path up to ``position`` and then commit ``token_ids[i]`` at
    ``position`` (instead of my path's token there), my drafts after it are
    ``continuations[i]``." The verifier keeps them with the request's tail; the commit that
    matches turns that continuation into the tail at once, as if a segment drafted on the new
    committed prefix had arrived, so no round trip to the drafter is waited for. Any other
    commit drops them. ``base_committed_len`` is the drafter's committed length when it made
    them; the path up to ``position`` is the one its DraftTailStream segments carried. One-hot
    drafts only (no draft_probs).

    Decoding refuses (ProtocolError) ``position < base_committed_len``, a continuation count
    that is not the candidate count, an empty continuation, and repeated candidates.
    """

    request_id: str
    base_committed_len: NonNegInt
    position: NonNegInt
    token_ids: list[TokenId]
    continuations: list[list[TokenId]]

    @classmethod
    def example(cls) -> DraftBranches:
        return cls(request_id="req-1", base_committed_len=4, position=4, token_ids=[11, 12],
                   continuations=[[13, 14], [15]])


# --------------------------------------------------------------------------------------------
# Drafter control: corpora and cross-request history (gateway -> verifier -> drafter)
# --------------------------------------------------------------------------------------------

#: most token ids one DrafterCorpus chunk carries (a header of a few hundred KB: a chunk never
#: holds a role's loop for long, and MAX_HEADER_BYTES is far away)
CORPUS_CHUNK_TOKENS = 65_536
#: most tokens one corpus may have (what the gateway accepts and a drafter assembles)
MAX_CORPUS_TOKENS = 4_194_304
#: longest corpus name; names are 1..MAX_CORPUS_NAME_LEN of ``[A-Za-z0-9._-]`` (they appear in
#: URLs and metrics)
MAX_CORPUS_NAME_LEN = 128


@register
class DrafterCorpus(Message, tag=50, kw_only=True):
    """Gateway -> verifier, relayed verifier -> drafter: an operation on the drafters'
    cross-request memory (docs/drafters.md, 'Corpora'). ``op`` (a protocol.enums.CorpusOp):

    - ``load``: corpus ``name`` is the token ids of chunks ``0 .. num_chunks - 1`` (each at
      most CORPUS_CHUNK_TOKENS, none empty) in order; it replaces a corpus of that name once
      the last chunk is in;
    - ``drop``: forget corpus ``name``;
    - ``clear_history``: forget what earlier requests left in the drafters' memory (a suffix
      drafter's global tree); corpora stay. ``name`` is empty.

    ``op_id`` names the operation (its results carry it) and orders the operations on one
    name: the gateway numbers them increasingly, so a drafter that gets the same operation
    from several verifiers applies it once, and one older than the last it applied for that
    name not at all.

    Decoding refuses (ProtocolError) an unknown op, a name that is not 1..MAX_CORPUS_NAME_LEN
    of ``[A-Za-z0-9._-]`` (empty for ``clear_history``), ``chunk_index >= num_chunks``, more
    chunks than MAX_CORPUS_TOKENS needs, an empty or oversize load chunk, and token ids or
    chunks on a drop or a clear.
    """

    op: str
    op_id: NonNegInt
    name: str
    token_ids: list[TokenId]
    chunk_index: NonNegInt = 0
    num_chunks: Annotated[int, Meta(ge=1)] = 1

    @classmethod
    def example(cls) -> DrafterCorpus:
        return cls(op="load", op_id=7, name="docs", token_ids=[5, 6, 7, 8], chunk_index=0,
                   num_chunks=2)


@register
class DrafterCorpusRelayed(Message, tag=51, kw_only=True):
    """Verifier -> gateway: DrafterCorpus ``op_id`` (its last chunk, for a load) went to
    ``drafters`` (the gateway then waits for a DrafterCorpusResult from each); ``error``
    non-empty: the verifier refused it (e.g. a chunk out of order) and relayed nothing more
    of it."""

    op: str
    op_id: NonNegInt
    name: str
    drafters: list[str] = msgspec.field(default_factory=list)
    error: str = ""

    @classmethod
    def example(cls) -> DrafterCorpusRelayed:
        return cls(op="load", op_id=7, name="docs", drafters=["drafter-0", "drafter-1"])


@register
class DrafterCorpusResult(Message, tag=52, kw_only=True):
    """Drafter -> verifier, relayed verifier -> gateway: how ``drafter`` answered DrafterCorpus
    ``op_id``: ``status`` (a protocol.enums.CorpusStatus), ``num_tokens`` (the tokens it holds
    under ``name`` afterwards) and ``error`` (why, for ``error`` and ``unsupported``)."""

    op: str
    op_id: NonNegInt
    name: str
    drafter: str
    status: str
    num_tokens: NonNegInt = 0
    error: str = ""

    @classmethod
    def example(cls) -> DrafterCorpusResult:
        return cls(op="load", op_id=7, name="docs", drafter="drafter-0", status="applied",
                   num_tokens=4)


# --------------------------------------------------------------------------------------------
# LoRA adapters at run time (gateway -> verifier -> prefill; engine/lora_runtime.py)
# --------------------------------------------------------------------------------------------

#: most adapters one LoraAdapterOp ``sync`` names
MAX_LORA_ADAPTERS = 1024


@register
class LoraAdapterOp(Message, tag=60, kw_only=True):
    """Gateway -> verifier, relayed verifier -> prefill: change the LoRA adapters a role serves
    at run time (vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``;
    docs/operations.md, 'LoRA adapters'). ``op`` (a protocol.enums.LoraOp):

    - ``load``: load the PEFT adapter at ``lora_path`` (a path the role's host can read) as
      ``lora_name``;
    - ``unload``: stop serving ``lora_name``; a role frees it once no request of its own uses
      it (running requests finish on it);
    - ``sync``: serve exactly ``adapters`` ({name: path}): what a role that (re)joined is sent,
      loading what it lacks and unloading what is not listed.

    ``lora_name`` and ``lora_path`` are "" where the op has none (an unload's path, a sync's
    both). ``op_id`` names the operation (each LoraAdapterResult carries it). Decoding refuses
    (ProtocolError) an unknown op, a load without name or path, an unload without a name, a
    sync with a name or path of its own.
    """

    op: str
    op_id: NonNegInt
    lora_name: str
    lora_path: str
    adapters: dict[str, str] = msgspec.field(default_factory=dict)

    @classmethod
    def example(cls) -> LoraAdapterOp:
        return cls(op="load", op_id=9, lora_name="caps", lora_path="/adapters/caps")


@register
class LoraAdapterResult(Message, tag=61, kw_only=True):
    """Verifier -> gateway (its own answer, and each prefill worker's, relayed): how role
    ``instance_id`` applied LoraAdapterOp ``op_id``. ``error`` non-empty: it failed, and
    ``not_found`` says whether because the adapter (a load's path, an unload's name) does not
    exist (vLLM answers 404 then, else 400). ``relayed_to``: the prefill workers the verifier
    sent the operation on to (the gateway waits for their answers too); ``num_in_use``: the
    requests that still run on an unloaded adapter (it is freed after them)."""

    op: str
    op_id: NonNegInt
    instance_id: str
    lora_name: str = ""
    error: str = ""
    not_found: bool = False
    relayed_to: list[str] = msgspec.field(default_factory=list)
    num_in_use: NonNegInt = 0

    @classmethod
    def example(cls) -> LoraAdapterResult:
        return cls(op="load", op_id=9, instance_id="verifier-0", lora_name="caps",
                   relayed_to=["prefill-0"])


__all__ = [
    "PROTOCOL_VERSION", "PLACEHOLDER_TOKEN_ID", "REGISTRY", "DTYPE_ITEMSIZE", "register",
    "Message", "NonNegInt", "TokenId", "buffer_nbytes",
    "Buffer", "ModelIdentity", "GrammarSpec", "SamplingParams", "TokenLogprobs", "MAX_LOGPROBS",
    "Hello", "HelloAck", "GenerateRequest",
    "TokenStream", "Abort", "PrefillRequest", "KVFrame", "PrefillDone", "PrefillCancel",
    "PrefillCancelAck", "DraftSync", "VerifyCommit", "DraftTailStream", "DraftBranches",
    "DraftClose",
    "DraftNeedSync", "DrafterCorpus", "DrafterCorpusRelayed", "DrafterCorpusResult",
    "CORPUS_CHUNK_TOKENS", "MAX_CORPUS_TOKENS", "MAX_CORPUS_NAME_LEN",
    "LoraAdapterOp", "LoraAdapterResult", "MAX_LORA_ADAPTERS", "SharedKVPool", "TargetKVRows",
    "DraftSeed", "MAX_DRAFT_SEED_TOPK",
]
