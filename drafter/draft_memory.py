"""What a drafting method costs the drafter role, as its stats report it: the bytes of its
weights and of its draft KV, and the draft forwards it has run (``specmesh bench``'s per-method
table, benchmarks/harness/method_table.py; issue 35 item 5 and issue 36's must-show).

A proposer reports three figures (drafter/proposer.py, :class:`Proposer`), each None when the
method does not report it (the bench then shows a blank, never a zero):

- ``draft_weights_bytes``: bytes of every tensor its model holds resident in the drafter
  process (:func:`resident_bytes`: parameters, buffers and the GGUF / Q8_0 blocks a module
  computes on, each storage once), the copies of the target's embedding and LM head a head
  reads included, since the drafter process holds them too; 0 for a method without a model;
- ``draft_kv_pool_bytes``: bytes of its draft KV: the preallocated pool of a draft LM
  (``engine.kv_cache.KVCache``), or for a method whose KV grows per request (an EAGLE head)
  the most bytes those buffers held at once; 0 for a method with no KV;
- ``num_draft_forwards``: the model forwards it has run so far, all requests of a batched
  call counting once (a chain pays one per draft position, a parallel drafter one per
  block, catch-up forwards over newly committed tokens included). The drafter worker turns
  its growth into the ``draft_forwards`` step-profile counter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

#: the proposer attributes :func:`drafter_costs` reports, in order
COST_FIELDS = ("draft_weights_bytes", "draft_kv_pool_bytes", "num_draft_forwards")


def _tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors held by ``obj``: itself, a module's parameters and buffers and the tensors
    (or block objects holding tensors, e.g. ``kernels.gguf_matmul.BlockWeight``) in each
    module's attributes, the items of a tuple or list, a dataclass's fields; two levels
    deep at most outside modules (so a walk never follows references into other objects)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            yield from m.parameters(recurse=False)
            yield from m.buffers(recurse=False)
            for value in vars(m).values():
                if not isinstance(value, (torch.nn.Module, dict)):
                    yield from _tensors(value, 1)
    elif depth < 3 and isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 3 and hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name, None), depth + 1)


def resident_bytes(*objs: Any) -> int:
    """Bytes of the storages behind every tensor of ``objs`` (modules, tensors, block
    objects; see :func:`_tensors`), each storage counted once however many tensors view it
    (tied weights, a float weight and its view)."""
    seen: dict[int, int] = {}
    for obj in objs:
        for t in _tensors(obj):
            storage = t.untyped_storage()
            key = storage.data_ptr() if storage.data_ptr() else id(storage)
            seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())


def drafter_costs(proposer: Any) -> dict[str, int]:
    """The :data:`COST_FIELDS` ``proposer`` reports (those that are not None), as ints: what
    the drafter role adds to its ``stats()``."""
    out = {}
    for name in COST_FIELDS:
        value = getattr(proposer, name, None)
        if value is not None:
            out[name] = int(value)
    return out


__all__ = ["COST_FIELDS", "drafter_costs", "resident_bytes"]
