"""Per-request buffer of draft tokens streamed ahead by the drafter (DESIGN.md §3 staleness rule).

Tokens decide staleness: a tail token is usable only if every tail token before it, and every
tail token at an already committed output position, equals what the verifier committed there.
The buffer always starts right after the committed prefix (output position ``committed_len``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TailStats:
    """Counters of one buffer (tokens, not segments, unless named ``num_*_segments``)."""

    num_received_tokens: int = 0
    num_stale_tokens: int = 0  # discarded because they disagreed with a commit
    num_gap_segments: int = 0  # segments dropped because they left a hole after the tail
    num_duplicate_tokens: int = 0  # already buffered or already committed, and equal
    num_replaced_tokens: int = 0  # buffered tokens superseded by a newer, different segment


class TailBuffer:
    """Draft tokens at output positions ``[committed_len, committed_len + len(tokens))``."""

    def __init__(self, committed_len: int = 0) -> None:
        self.start = committed_len
        self.tokens: list[int] = []
        self.stats = TailStats()

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        """Output position one past the last buffered draft token."""
        return self.start + len(self.tokens)

    def reset(self, committed_len: int) -> None:
        """Forget every buffered token (e.g. after a DraftSync re-open)."""
        self.start = committed_len
        self.tokens.clear()

    def add(self, start_pos: int, draft_token_ids: list[int], committed: list[int]) -> int:
        """Merge a DraftTailStream segment; ``committed`` is the full committed output.

        Returns the number of new tokens appended. A segment that disagrees with a committed
        token is stale from that token on; one that starts past the buffered end is a gap and
        is dropped whole; a part that overlaps the buffer and disagrees replaces the buffer
        from the first difference (the drafter changed its path).
        """
        if start_pos < 0:
            raise ValueError(f"negative start_pos {start_pos}")
        self.stats.num_received_tokens += len(draft_token_ids)
        committed_len = len(committed)
        if self.start != committed_len:  # commits always go through on_commit first
            self.reset(committed_len)
        toks = draft_token_ids
        pos = start_pos
        # Part of the segment that lies inside the committed prefix must equal it.
        while toks and pos < committed_len:
            if toks[0] != committed[pos]:
                self.stats.num_stale_tokens += len(toks)
                return 0
            self.stats.num_duplicate_tokens += 1
            toks = toks[1:]
            pos += 1
        if not toks:
            return 0
        if pos > self.end:
            self.stats.num_gap_segments += 1
            return 0
        # Overlap with the buffered tail.
        i = pos - self.start
        while toks and i < len(self.tokens):
            if toks[0] != self.tokens[i]:
                self.stats.num_replaced_tokens += len(self.tokens) - i
                del self.tokens[i:]
                break
            self.stats.num_duplicate_tokens += 1
            toks = toks[1:]
            i += 1
        self.tokens.extend(toks)
        return len(toks)

    def on_commit(self, committed: list[int]) -> None:
        """Advance past newly committed tokens; on the first disagreement drop the whole tail."""
        new_len = len(committed)
        n = min(new_len - self.start, len(self.tokens))
        for i in range(n):
            if self.tokens[i] != committed[self.start + i]:
                self.stats.num_stale_tokens += len(self.tokens) - i
                self.reset(new_len)
                return
        del self.tokens[: max(new_len - self.start, 0)]
        self.start = new_len

    def usable(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` drafts for the next verify step (positions from committed_len)."""
        return self.tokens[: max(max_tokens, 0)]
