"""Incremental detokenization and stop-string matching for streamed output
(docs/architecture.md, 'Life of a request' step 5).

Tokens arrive a few at a time. Decoding each delta on its own is wrong twice over: byte-level
BPE splits one multi-byte UTF-8 character over several tokens (an emoji is often 4 tokens), and
SentencePiece-style tokenizers drop or add a leading space depending on context. We therefore
decode a small *window* of the growing sequence: ``prefix_offset`` marks where the window starts
(a point where the text was complete) and ``read_offset`` marks how much has already been
emitted. The delta is the window's text minus the text of the already-emitted part of the window.
A window whose text ends in U+FFFD (the replacement character of an incomplete byte sequence) is
held back until the following token completes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"

#: prompt tokens placed in front of the first window so the first output token decodes in context
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turn a growing token sequence into text deltas that never split a UTF-8 character.

    Args:
        tokenizer: any object with ``decode(ids, skip_special_tokens=...) -> str``.
        prompt_token_ids: the prompt; its last few tokens are decoding context only and never
            appear in the output.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.num_output_tokens = 0
        self.text = ""  # everything returned so far (by add and flush)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _window_delta(self, force: bool) -> str:
        emitted = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._decode(self._ids[self._prefix_offset:])
        if len(window) <= len(emitted):
            return ""  # e.g. only special tokens were added
        if window.endswith(REPLACEMENT_CHAR) and not force:
            return ""  # an incomplete character: wait for the bytes that finish it
        delta = window[len(emitted):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta

    def add(self, token_ids: Iterable[int]) -> str:
        """Append output tokens; return the newly completed text (possibly ``""``)."""
        new = [int(t) for t in token_ids]
        if not new:
            return ""
        self._ids.extend(new)
        self.num_output_tokens += len(new)
        delta = self._window_delta(force=False)
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: return any held-back text, incomplete characters included."""
        delta = self._window_delta(force=True)
        self.text += delta
        return delta


class StopStringMatcher:
    """Find stop strings in streamed text, even when one spans several deltas.

    ``feed`` returns the text that is safe to emit: everything before a stop string (which is
    itself never emitted, as in the OpenAI API), and otherwise everything except the longest
    suffix that could still grow into a stop string. After a stop, further input is discarded.
    """

    def __init__(self, stops: Iterable[str] | None) -> None:
        self.stops = [s for s in (stops or []) if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return ``(emit_text, stopped)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first, which = -1, None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (first < 0 or i < first):
                first, which = i, stop
        if first >= 0:
            self._held = ""
            self.stopped = True
            self.matched = which
            return buf[:first], True
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
