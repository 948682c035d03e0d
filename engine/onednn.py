"""Linear layers on prepacked oneDNN weights (CPU): the weight-prepacking torch inductor's
``freezing`` does for CPU inference, without compiling the model.

``F.linear`` on CPU hands oneDNN / MKL the plain row-major weight on every call, and the
library reorders it into its blocked layout each time. For the decode-size products of a small
model that reorder is most of the cost (docs/benchmarks.md, 'Linear layers').

Whether a process uses prepacked products at all is its backend's ``prepacked_linear`` choice
(:mod:`engine.backend`); the layers (engine/linear.py) ask it, this module does not.

Results are row-invariant as the verify forward needs (docs/architecture.md, 'Batch
invariance'): a row's output does
not depend on how many rows the call has, for 2 rows and up, nor on the thread count; a
one-row call may take another kernel (gemv) whose last bits differ, so one-row inputs run as
two rows (the row twice), as :class:`engine.linear.RowInvariantLinear` already did for bf16.
Prepacked fp32 results are not bit-equal to eager ``F.linear`` (another accumulation order),
only consistent with themselves.

:func:`pack` checks the property on random rows before a pack is used and returns None where
the op is missing or the check fails; the caller then stays on ``F.linear``.
"""

from __future__ import annotations

import torch

#: Dtypes packed for oneDNN (float64 and float16 stay on F.linear).
PACKED_DTYPES = (torch.float32, torch.bfloat16)
#: Batch-size hint of the pack: the decode steps the engine runs most.
_PACK_BATCH_HINT = 2
#: Rows of the pack-time check: every count below is compared with its rows in the largest.
_CHECK_ROWS = (2, 3, 5, 9)
_CHECK_ALL = 17
_AVAILABLE = bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn,
                                                                     "_linear_pointwise")


def available() -> bool:
    """Whether this torch has the oneDNN linear ops the packs need (a fact of the build, not a
    choice: engine/backend.py decides from it)."""
    return _AVAILABLE


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] @ weight.T (+ bias) -> [M, out] on a weight from :func:`pack`; M == 1 runs
    as two rows (row invariance, see the module docstring)."""
    if x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(torch.cat([x, x]), packed, bias,
                                                  "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN blocked copy of ``weight`` [out, in] (same dtype, CPU), or None: not a
    packed dtype, not on CPU, the op missing, or rows computed in calls of different sizes
    disagree on a random check (then F.linear stays in use). Costs one copy of the weight's
    memory."""
    if weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu" or not _AVAILABLE:
        return None
    w = weight.detach()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(_CHECK_ALL, w.shape[1], generator=gen).to(w.dtype)
        b = None if bias is None else bias.detach()
        full = linear(x, packed, b)
        for rows in (1, *_CHECK_ROWS):
            if not torch.equal(linear(x[:rows], packed, b), full[:rows]):
                return None
    except (RuntimeError, NotImplementedError):  # op missing or dtype unsupported here
        return None
    return packed


class PackCache:
    """One weight's pack, kept while the weight (and bias) keep their storage and version: a
    new tensor, an in-place update (``load_state_dict``, an optimizer step) or another dtype
    packs again. It holds the packed tensors' storages, so a new tensor cannot take their
    address while the pack is in use."""

    def __init__(self) -> None:
        self.packed: torch.Tensor | None = None
        self._key: tuple | None = None
        self._held: tuple = ()
        self.fused_bias: torch.Tensor | None = None  # get_fused's concatenated bias

    def get(self, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """The pack to compute ``x`` [M, in] with, or None where ``F.linear`` must: no oneDNN,
        not a 2-D CPU input of the weight's dtype, or autograd recording. Called on every
        product, so it checks no more than it must."""
        if not _usable(x, weight):
            return None
        key = (weight.data_ptr(), weight._version) if bias is None else \
            (weight.data_ptr(), weight._version, bias.data_ptr(), bias._version)
        if key != self._key:
            self.packed, self._key = pack(weight, bias), key
            self._held = (weight.detach(),) if bias is None else (weight.detach(), bias.detach())
        return self.packed

    def get_fused(self, x: torch.Tensor, weights: list[torch.Tensor],
                  biases: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """:meth:`get` for several weights [out_i, in] over the same input, packed as one
        [sum out_i, in] weight (``biases``: one per weight, or None); the pack's bias is
        :attr:`fused_bias`."""
        if not _usable(x, weights[0]):
            return None
        parts = [*weights, *(biases or [])]
        key = tuple((t.data_ptr(), t._version) for t in parts)
        if key != self._key:
            w = torch.cat([t.detach() for t in weights])
            self.fused_bias = None if biases is None else torch.cat([b.detach() for b in biases])
            self.packed, self._key = pack(w, self.fused_bias), key
            self._held = tuple(t.detach() for t in parts)
        return self.packed


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A product a pack can compute: oneDNN there, a 2-D CPU input of the weight's dtype, no
    autograd recording."""
    return (_AVAILABLE and x.dim() == 2 and x.dtype == weight.dtype and x.is_cpu
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


__all__ = ["PACKED_DTYPES", "PackCache", "available", "linear", "pack"]
