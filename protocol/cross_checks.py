"""Checks of decoded wire messages that span fields (run by protocol/codec.py after msgspec has
checked each field's type and bounds): a DraftTailStream's ``parents`` one per draft and pointing
inside the segment, ``start_pos >= base_committed_len``, ``draft_probs`` rows = drafts, a
prediction segment a chain without ``draft_probs``; a
DraftBranches' continuations one per candidate, non-empty, candidates distinct. Each check
returns "" when the message is fine, else why not (the codec raises it as a ProtocolError).
Constructing a message locally runs none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specmesh.protocol.messages import DraftBranches, DraftTailStream


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


#: message class -> check of the decoded message returning an error ("" when valid)
CROSS_FIELD_CHECKS: dict[type, Callable[[Any], str]] = {
    DraftTailStream: check_draft_tail,
    DraftBranches: check_draft_branches,
}
