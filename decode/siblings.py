"""Sibling requests: the ``n`` choices (``best_of`` candidates) of one prompt, prefilled once.

The gateway sends each choice as its own GenerateRequest with the same ``group`` and
``group_size`` (protocol/messages.py). The first to arrive leads: it alone is prefilled, with
its siblings' sampling on the PrefillRequest, and the prefill worker samples every sibling's
first token from the same last-position logits (PrefillDone.sibling_first_token_ids). When the
leader's KV has arrived, each sibling still waiting is forked from it: it holds the leader's
full prompt blocks (shared, reference-counted by the block manager: positions before the prompt's
end are never written again) and its own copy of the prompt's last, partial block (written past
the prompt by its own verify steps: copy on write, decided at the fork). From then on a sibling
is an ordinary request (its own drafts, commits, stream and abort). vLLM serves ``n`` the same
way (a parent request whose children share the prompt's cached blocks).

A sibling that cannot be forked (the leader failed or was aborted before its KV arrived, no KV
room or sequence slot at the fork, a missing first token) stays in the queue as an ordinary
request and is prefilled on its own: its output is the same either way (a choice's first token
depends only on the prompt's logits and its own sampling).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specmesh.decode.request import Request, RequestStatus

#: How long a leader waits for the rest of its group to arrive before it is prefilled anyway
#: (seconds): the gateway sends a group's requests back to back, so this only bounds a group
#: whose members were lost or refused on the way.
GROUP_ARRIVAL_WAIT_S = 0.05


class SiblingGroups:
    """Which waiting request leads which group, per gateway.

    ``clock``: monotonic seconds (a fake one in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._leaders: dict[tuple[str, str], Request] = {}

    def join(self, req: Request, group: str, group_size: int) -> None:
        """Link a new request of ``group`` (from ``req.gateway``) to the group's waiting leader,
        or make it the leader. A group whose leader was already admitted gets a new leader."""
        if not group or group_size < 2:
            return
        req.group = group
        key = (req.gateway, group)
        leader = self._leaders.get(key)
        if leader is not None and leader.status is RequestStatus.WAITING \
                and len(leader.followers) + 1 < leader.group_size:
            req.leader = leader
            leader.followers.append(req)
            return
        req.group_size = group_size
        self._leaders[key] = req

    def ready(self, leader: Request) -> bool:
        """Whether ``leader`` may be admitted: its whole group arrived, or it waited
        :data:`GROUP_ARRIVAL_WAIT_S`."""
        return len(leader.followers) + 1 >= leader.group_size \
            or self.clock() - leader.arrival_time >= GROUP_ARRIVAL_WAIT_S

    def holds(self, req: Request) -> bool:
        """Whether admission passes over waiting ``req``: a sibling waits for its leader's KV,
        a leader for the rest of its group (:meth:`ready`)."""
        return req.leader is not None or (req.group_size > 1 and not self.ready(req))

    def admitted(self, leader: Request) -> list[Request]:
        """``leader`` is being prefilled: the group is closed (a late member leads a new one);
        returns the siblings whose first tokens its prefill samples, fixed for its transfers."""
        key = (leader.gateway, leader.group)
        if self._leaders.get(key) is leader:
            del self._leaders[key]
        leader.fork_targets = [f for f in leader.followers if f.status is RequestStatus.WAITING]
        return leader.fork_targets

    def unlink(self, req: Request) -> None:
        """``req`` ended (or will not be forked): a leader's siblings become ordinary requests,
        a sibling leaves its leader's group."""
        for f in req.followers:
            f.leader = None
        req.followers, req.fork_targets = [], []
        if req.leader is not None:
            leader, req.leader = req.leader, None
            if req in leader.followers:
                leader.followers.remove(req)
        key = (req.gateway, req.group)
        if self._leaders.get(key) is req:
            del self._leaders[key]

    @staticmethod
    def num_shared_blocks(prompt_len: int, block_size: int) -> int:
        """Prompt blocks every sibling may hold: the full ones (a partial last block is written
        past the prompt, so each sibling gets its own copy)."""
        return prompt_len // block_size


__all__ = ["GROUP_ARRIVAL_WAIT_S", "SiblingGroups"]
