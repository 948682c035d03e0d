"""Drafting with a multi-layer EAGLE head (drafter/eagle/steps.py): the per-module KV of one
request over its context, and chains that run module i at depth i.

Module 0's state is the 1-module head's (the proposer's ``_HeadState``: the target's true
states in, a :class:`~drafter.eagle.head_kv.HeadKV` and the predicted state of each entry).
Module m >= 1 keeps a :class:`StepState` whose entry at position p reads module m - 1's
predicted state at p - 1 and the context's token at p + 1: :func:`catch_up_steps` brings every
module up to the context's second-to-last position after module 0 (one batched forward per
module for all requests). A chain's draft at depth j >= 2 is then one entry of module
``step_of_depth(j)`` at position ``L - 2 + (j - 1)`` run beside that module's KV
(:class:`StepChains`, through drafter/eagle/head_tree.py's tree forward: it never writes the
KV, so nothing has to be rolled back after verification).

Memory: each module keeps, per request and per context position, its layers' keys and values
(``2 * num_layers * num_kv_heads * head_dim`` floats), where a 1-module head keeps one such KV:
:func:`kv_pool_bytes` counts the buffers held.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specmesh.drafter.eagle.head import EagleHead
from specmesh.drafter.eagle.head_kv import HeadKV
from specmesh.drafter.eagle.head_tree import TreeKV, tree_level_many


class ModuleState(Protocol):
    """What a module's per-request state has: its KV and the predicted state of each entry
    (``outs[i]`` of the entry at position ``kv.start + i``)."""

    kv: HeadKV
    outs: list[torch.Tensor]


@dataclass
class StepState:
    """Module m >= 1's state for one request (:class:`ModuleState`)."""

    kv: HeadKV = field(default_factory=HeadKV)
    outs: list[torch.Tensor] = field(default_factory=list)

    def truncate(self, end: int) -> None:
        """Keep the entries at positions ``< end``."""
        if self.kv.length and end < self.kv.end:
            self.kv.truncate(end)
            del self.outs[self.kv.length:]


def truncate_steps(first: ModuleState, steps: list[StepState], end: int) -> None:
    """After module 0 (``first``) kept its entries before ``end``: module m keeps those that
    read a kept state of module m - 1 (positions up to its end) and a token before ``end``."""
    prev = first
    for s in steps:
        s.truncate(min(end, prev.kv.end + 1) if prev.kv.length else s.kv.start)
        prev = s


def kv_pool_bytes(kvs: list[HeadKV]) -> int:
    """Bytes of the key and value buffers held by ``kvs`` (their capacity, not just the
    entries in use)."""
    return sum(t.numel() * t.element_size() for kv in kvs
               for t in (*kv.key_buffers, *kv.value_buffers))


class StepClock:
    """Seconds and forwards of each module of a head (``draft_step_ms`` in the drafter's
    stats: a module's mean milliseconds per drafting call, the numerator of its ``c_i``)."""

    def __init__(self, num_steps: int) -> None:
        self.seconds = [0.0] * num_steps
        self.forwards = [0] * num_steps
        self.calls = 0

    def run(self, step: int, fn, *args):  # noqa: ANN001, ANN201
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds[step] += time.perf_counter() - t0
            self.forwards[step] += 1

    def ms_per_call(self) -> list[float]:
        return [round(1e3 * s / max(self.calls, 1), 4) for s in self.seconds]


def catch_up_steps(head: EagleHead, reqs: list[tuple[list[ModuleState], list[int]]],
                   clock: StepClock | None = None) -> None:
    """Bring modules 1.. of each request up to its context: ``reqs`` are per request its
    modules' states (index 0: module 0's, already caught up) and its context token ids;
    module m's missing entries up to position ``len(ctx) - 2`` run in one forward of module m
    for every request (:meth:`EagleHead.extend_many`)."""
    for m in range(1, head.config.num_steps):
        items, where = [], []
        for mods, ctx in reqs:
            prev, cur = mods[m - 1], mods[m]
            if not prev.kv.length:
                continue
            lo = cur.kv.end if cur.kv.length else prev.kv.start + 1
            hi = min(len(ctx) - 2, prev.kv.end)  # entry p reads prev's state at p - 1
            if lo > hi:
                continue
            a = prev.kv.start
            items.append((cur.kv, torch.stack(prev.outs[lo - 1 - a:hi - a]),
                          torch.tensor(ctx[lo + 1:hi + 2], dtype=torch.long), lo))
            where.append(cur)
        if items:
            outs = (clock.run(m, head.extend_many, items, m) if clock
                    else head.extend_many(items, m))
            for cur, out in zip(where, outs):
                cur.outs.extend(out)


class StepChains:
    """The chains of several requests after their anchors (the context length whose last
    true state module 0 read), one entry per depth: the entry of depth j runs module
    ``step_of_depth(j)`` beside that request's KV of the module; a repeated last module's
    entries attend to the chain's earlier entries of that module (as the 1-module head's chain
    does). Entries of the same module for several requests run in one forward. The proposer
    keeps one per worker, its requests' chains by request id (:meth:`drop` forgets one)."""

    def __init__(self, head: EagleHead, clock: StepClock | None = None) -> None:
        self.head, self.clock = head, clock
        self.trees: dict[tuple, TreeKV] = {}  # (request key, module) -> chain entries
        self.last: dict = {}  # request key -> (module, entry) of its last entry

    def drop(self, key) -> None:  # noqa: ANN001
        """Forget request ``key``'s chain."""
        self.last.pop(key, None)
        for m in range(self.head.config.num_steps):
            self.trees.pop((key, m), None)

    def nbytes(self) -> int:
        """Bytes of the chain entries' keys and values held."""
        return sum(t.numel() * t.element_size() for tree in list(self.trees.values())
                   for t in (*tree.keys, *tree.values))

    @torch.inference_mode()
    def step(self, depth: int, reqs: dict) -> dict:
        """Run depth ``depth`` (>= 2) of the chains ``reqs``: per request key its modules'
        states (:class:`ModuleState`, module 0 first), its anchor L (entries of every module
        up to position L - 2), the state ``[d]`` the previous depth predicted and the token
        drafted from it. Returns per key the predicted state ``[d]`` (whose logits are the
        distribution of draft ``depth``); none past the last module of a "stop" head."""
        return self.advance({k: (*v, depth) for k, v in reqs.items()})

    @torch.inference_mode()
    def advance(self, reqs: dict) -> dict:
        """:meth:`step` with each request at its own depth: ``reqs`` maps a key to ``(mods,
        L, state, token, depth)``; one forward per module for the requests it runs."""
        groups: dict[int, list] = {}
        for key, (mods, L, g, tok, depth) in reqs.items():
            m = self.head.config.step_of_depth(depth)
            if m is not None:
                groups.setdefault(m, []).append((key, mods, L, g, tok, depth))
        out = {}
        for m, group in groups.items():
            items, keys = [], []
            for key, mods, L, g, tok, depth in group:
                kv = mods[m].kv
                tree = self.trees.get((key, m))
                if tree is None:
                    tree = self.trees[(key, m)] = TreeKV(kv, kv.length if kv.end == L - 1
                                                         else 0)
                last = self.last.get(key)
                parent = last[1] if last is not None and last[0] == m else -1
                items.append((tree, g[None], torch.tensor([tok], dtype=torch.long),
                              torch.tensor([L - 2 + depth - 1], dtype=torch.long), [parent]))
                keys.append(key)
            outs = (self.clock.run(m, tree_level_many, self.head, items, m) if self.clock
                    else tree_level_many(self.head, items, m))
            for key, (tree, *_), o in zip(keys, items, outs):
                self.last[key] = (m, len(tree) - 1)
                out[key] = o[0]
        return out


__all__ = ["ModuleState", "StepChains", "StepClock", "StepState", "catch_up_steps",
           "kv_pool_bytes", "truncate_steps"]
