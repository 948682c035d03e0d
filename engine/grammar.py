"""Structured output: a request's grammar (protocol GrammarSpec) compiled by llguidance into a
token matcher, and the token masks it gives each verified position.

vLLM and SGLang do the same with xgrammar / llguidance: a matcher per request, a token bitmask
per position, the matcher advanced over accepted tokens and rolled back over rejected drafts.
Under speculation (docs/verification.md) the verifier asks :class:`RequestGrammar` for the mask
of every row of a verify chunk (row i: the state after drafts ``d_0 .. d_{i-1}``), cuts drafts
the grammar refuses before the forward and advances the matcher over the committed tokens only;
the prefill worker masks output position 0 with the grammar's initial state. So a constrained
request's output is the same with speculation on or off, token for token.

The gateway compiles every spec once (:meth:`GrammarCompiler.check`) so a broken schema, regex
or grammar is an HTTP 400 that says why; the roles compile it again for their own tokenizer
(cached by spec, off the step's critical path: :meth:`GrammarCompiler.submit`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.gbnf_to_lark as gbnf
import llguidance.hf
import torch
from llguidance import LLMatcher

from specmesh.protocol.messages import GrammarSpec

log = logging.getLogger(__name__)

#: spec kinds (GrammarSpec.kind) and what their value is
GRAMMAR_KINDS = ("json_schema", "regex", "lark")
#: compiled grammars kept per compiler (least recently used dropped first)
MAX_CACHED_GRAMMARS = 256
#: JSON output is compact (``", "`` / ``": "`` separators, no free whitespace): a model that
#: follows the mask cannot run the request's tokens out on whitespace (llguidance's
#: ``whitespace_flexible`` off)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec`` (its top-level JSON form).

    Raises:
        ValueError: an unknown kind, or a ``json_schema`` value that is not a JSON object.
    """
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as err:
            raise ValueError(f"the JSON schema is not valid JSON: {err}") from err
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be a JSON object")
        return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.value)
    raise ValueError(f"unknown grammar kind {spec.kind!r} (one of {', '.join(GRAMMAR_KINDS)})")


def lark_choice(choices: list[str]) -> str:
    """A Lark grammar matching exactly one of ``choices`` (vLLM's ``guided_choice``); each
    choice is a JSON-escaped string literal."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def gbnf_to_lark(grammar: str) -> str:
    """A GBNF (llama.cpp) grammar in llguidance's Lark dialect (vLLM's ``guided_grammar``
    takes either); text without ``::=`` is taken as Lark already.

    Raises:
        ValueError: a GBNF grammar llguidance cannot convert (the message says where).
    """
    if "::=" not in grammar:
        return grammar
    try:
        return gbnf.gbnf_to_lark(grammar)
    except Exception as err:  # noqa: BLE001 - the converter raises plain exceptions
        raise ValueError(f"cannot read the GBNF grammar: {err}") from err


class RequestGrammar:
    """One request's matcher, always at the request's committed tokens between steps.

    ``vocab_size``: the logits' width (the model's vocabulary; ids past the tokenizer's are
    never allowed). Methods that look ahead (:meth:`valid_drafts`, :meth:`masks`) consume
    tokens and roll them back (llguidance's rollback), so they leave the state unchanged.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no token but EOS: the request ends here."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """The matcher's error ("" when none; a matcher in error stays there)."""
        return self.matcher.get_error() if self.matcher.is_error() else ""

    def valid_drafts(self, draft_token_ids: list[int]) -> int:
        """How many leading drafts the grammar allows in a row: drafts from the first it
        refuses on cannot be accepted, and drafts past the token that completes the grammar
        would be cut by the commit, so neither is worth a forward row."""
        n = self.matcher.validate_tokens(draft_token_ids)
        consumed = 0
        for tok in draft_token_ids[:n]:
            if not self.matcher.consume_token(tok):  # validate_tokens said it fits
                break
            consumed += 1
            if self.matcher.is_stopped():
                break
        self._rollback(consumed)
        return consumed

    def masks(self, draft_token_ids: list[int], device: torch.device | str = "cpu"
              ) -> torch.Tensor:
        """The allowed tokens of a verify chunk's rows: bool [len(drafts) + 1, vocab_size],
        row i after ``drafts[:i]`` (all of them allowed: :meth:`valid_drafts` cut the
        rest). A row with nothing allowed (after a draft that ended the grammar) allows
        everything: the commit cuts the output before it."""
        bits = torch.zeros(len(draft_token_ids) + 1, self._words, dtype=torch.int32)
        consumed = 0
        for i in range(len(draft_token_ids) + 1):
            if i:
                tok = draft_token_ids[i - 1]
                # never consume a refused token: a matcher in error stays there
                if self.matcher.validate_tokens([tok]) != 1:
                    bits[i:] = -1  # not reached: drafts are cut by valid_drafts first
                    break
                self.matcher.consume_token(tok)
                consumed += 1
            row = bits[i]
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        self._rollback(consumed)
        allowed = unpack_bitmask(bits, self.vocab_size)
        empty = ~allowed.any(dim=1)
        if empty.any():
            allowed[empty] = True
        return allowed.to(device)

    def advance(self, token_ids: list[int]) -> int:
        """Consume committed ``token_ids`` up to and including the one that completes the
        grammar; returns how many it consumed (the caller commits that many and rolls back,
        :meth:`rollback`, any it then cuts). A token the grammar refuses stops it there
        (it cannot happen for tokens drawn under :meth:`masks`)."""
        n = 0
        for tok in token_ids:
            if self.matcher.is_stopped() or self.matcher.validate_tokens([tok]) != 1:
                break
            self.matcher.consume_token(tok)
            n += 1
        return n

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed (tokens advanced over but not committed)."""
        self._rollback(num_tokens)

    def _rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self.error}")


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from llguidance's bitmask int32 [rows, ceil(vocab / 32)]
    (token t is bit ``t % 32`` of word ``t // 32``)."""
    shifts = torch.arange(32, dtype=torch.int32)
    out = (bits.unsqueeze(-1) >> shifts) & 1
    return out.reshape(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, allowed: torch.Tensor) -> None:
    """Set the disallowed entries of ``logits`` [rows, vocab] to -inf in place (``allowed``:
    bool, as wide as the logits or narrower: ids past it are disallowed)."""
    width = allowed.shape[1]
    if width < logits.shape[1]:
        logits[:, width:] = float("-inf")
    logits[:, :width].masked_fill_(~allowed.to(logits.device), float("-inf"))


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer, keeping the compiled matchers by spec.

    ``tokenizer``: the Hugging Face (fast) tokenizer of the target; ``eos_token_ids``: the ids
    that end a request (the grammar allows them only where it may end; default the
    tokenizer's EOS); ``vocab_size``: the logits' width (default the tokenizer's).
    A new request gets a copy of the cached matcher (llguidance's ``deep_copy``: microseconds;
    compiling takes milliseconds to seconds). :meth:`submit` compiles on a worker thread
    (llguidance drops the GIL), so the verifier's loop goes on while a grammar compiles.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...] | list[int] = (),
                 vocab_size: int | None = None) -> None:
        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=eos)
        self.vocab_size = vocab_size or self.tokenizer.vocab_size
        self._cache: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def check(self, spec: GrammarSpec) -> str:
        """Why ``spec`` cannot be compiled ("" when it can): the llguidance compiler's
        message (a bad schema, regex or grammar)."""
        try:
            text = grammar_text(spec)
        except ValueError as err:
            return str(err)
        try:
            return LLMatcher.validate_grammar(text, self.tokenizer)
        except Exception as err:  # noqa: BLE001 - the compiler raises plain exceptions
            return str(err)

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher for ``spec`` (compiled once per spec).

        Raises:
            ValueError: the spec does not compile (the message says why).
        """
        key = (spec.kind, spec.value)
        with self._lock:
            base = self._cache.get(key)
            if base is not None:
                self._cache.move_to_end(key)
        if base is None:
            why = self.check(spec)
            if why:
                raise ValueError(why)
            base = LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
            if base.is_error():
                raise ValueError(base.get_error())
            with self._lock:
                self._cache[key] = base
                while len(self._cache) > MAX_CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return RequestGrammar(base.deep_copy(), self.vocab_size)

    def submit(self, spec: GrammarSpec) -> Future:
        """:meth:`matcher` on a worker thread: a Future of the RequestGrammar (its exception
        a ValueError when the spec does not compile)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        return self._pool.submit(self.matcher, spec)


def compiler_for(tokenizer: Any, eos_token_ids: tuple[int, ...] | list[int] = (),
                 vocab_size: int | None = None) -> GrammarCompiler | None:
    """A role's compiler for the target's ``tokenizer``, or None (logged) when there is no
    tokenizer or llguidance cannot read it (a slow tokenizer): that role then refuses
    constrained requests with a message that says so."""
    if tokenizer is None:
        log.warning("no tokenizer: structured output is refused")
        return None
    try:
        return GrammarCompiler(tokenizer, eos_token_ids, vocab_size)
    except (ValueError, TypeError) as err:
        log.warning("structured output is refused: llguidance cannot read the tokenizer: %s",
                    err)
        return None


def first_token_masks(compiler: GrammarCompiler | None, specs: list[GrammarSpec | None],
                      device: torch.device | str = "cpu") -> tuple[list[int], torch.Tensor | None]:
    """The masks of output position 0 for a batch whose requests carry ``specs`` (None:
    unconstrained): ``(rows, allowed)`` with ``allowed`` bool [len(rows), vocab] for the
    constrained rows, or ``([], None)`` when none is.

    Raises:
        ValueError: a spec given without a compiler, or one that does not compile.
    """
    rows = [i for i, s in enumerate(specs) if s is not None]
    if not rows:
        return [], None
    if compiler is None:
        raise ValueError("structured output needs the tokenizer on this role")
    masks = [compiler.matcher(specs[i]).masks([], device) for i in rows]
    return rows, torch.cat(masks)
