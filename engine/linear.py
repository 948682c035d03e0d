"""A linear layer whose result for a row does not depend on how many rows the call has.

Batch invariance (docs/architecture.md, 'Batch invariance') needs every op of the verify forward to
compute a row bit for bit as a one-token decode step does. CPU BLAS takes another kernel for a
one-row product than for two or more: on AVX-512 bf16 CPUs (oneDNN / MKL bf16 GEMM) a bf16 row
computed alone differs in the last bit from the same row computed among others, while products of
two or more rows agree row by row (docs/benchmarks.md, 'Linear layers'). After rounding to bf16 such
a bit flips greedy tokens at near-ties, so speculation's output drifted from plain decoding's.
:class:`RowInvariantLinear` computes a one-row bf16 / fp16 input as two rows (the row twice) and
keeps the first. On F.linear, float32 and float64 keep the one-row fast path (GEMV; a 2-row fp32
GEMM costs several times more on AVX2): float32's last-bit differences are far rarer at argmax than
bf16's (no test or bench prompt has flipped), but they are not ruled out. Inference on CPU in
float32 and bf16 runs on prepacked oneDNN weights instead (engine/onednn.py), where one-row inputs
also run as two rows, which rules them out for float32 too. A float32 layer loaded from a GGUF file
computes on the file's quantized blocks instead (kernels/gguf_matmul.py, attached by
engine/gguf_weights.py), row-invariant by construction. Which of these a layer uses is its CPU
backend's choice (engine/backend.py), given at construction and shared by every layer of a model.
"""

from __future__ import annotations

import torch
from torch import nn

from specmesh.engine import onednn
from specmesh.engine.backend import CpuBackend, default_backend
from specmesh.kernels.gguf_matmul import BlockWeight, gguf_matmul

#: Dtypes whose one-row products are computed as two rows.
PADDED_DTYPES = (torch.bfloat16, torch.float16)


class RowInvariantLinear(nn.Linear):
    """``nn.Linear`` (same parameters and state-dict names) whose output row i equals what
    any other call containing the same input row computes: inputs ``x`` [M, in] with M == 1
    in bf16 / fp16 run as [2, in].

    Inference on CPU in fp32 / bf16 (no autograd) runs on a prepacked oneDNN copy of the
    weight (:mod:`engine.onednn`: faster decode-size products, row-invariant in fp32
    too) where ``backend.prepacked_linear`` is on, packed on first use and again whenever the
    weight or bias changes (a new tensor, an in-place update such as ``load_state_dict``,
    another dtype). Other cases are plain ``nn.Linear``.

    ``backend``: the CPU backend (engine/backend.py; None: the process's
    :func:`~engine.backend.default_backend`); the other arguments are ``nn.Linear``'s.
    """

    def __init__(self, *args, backend: CpuBackend | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backend = backend if backend is not None else default_backend()
        self._pack_cache = onednn.PackCache()
        self._fused_into: FusedLinears | None = None  # packed with others (prepack skips it)
        self._blocks: BlockWeight | None = None
        self._blocks_key: tuple | None = None
        self._lora = None  # engine/lora.py's LinearLora: per-row adapter deltas, when attached

    def attach_blocks(self, blocks: BlockWeight) -> None:
        """Compute on ``blocks``, which expand to the current weight [out, in] bit for bit
        (engine/gguf_weights.py checks that); a later change of the weight drops them."""
        self._blocks, self._blocks_key = blocks, (self.weight.data_ptr(), self.weight._version)

    def blocks_for(self, x: torch.Tensor) -> BlockWeight | None:
        """The GGUF blocks to compute ``x`` [M, in] with, or None: none attached, the weight
        changed since, or not a float32 CPU input without autograd."""
        if self._blocks is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu \
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            return None
        if (self.weight.data_ptr(), self.weight._version) != self._blocks_key:
            self._blocks = None  # the weight changed: its blocks no longer hold it
            return None
        return self._blocks

    @property
    def _packed(self) -> torch.Tensor | None:
        """The current oneDNN pack the layer's products use: its own, or its
        :class:`FusedLinears` group's (None before first use or where unused)."""
        if self._fused_into is not None:
            return self._fused_into._pack_cache.packed
        return self._pack_cache.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] (plus the rows' LoRA deltas, engine/lora.py,
        within a batch of adapters)."""
        y = self._base(x)
        if self._lora is not None:
            self._lora.add_to(x, y)
        return y

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks_for(x)
        if blocks is not None:
            y = gguf_matmul(x, blocks)
            return y if self.bias is None else y.add_(self.bias)
        if self.backend.prepacked_linear.on:
            packed = self._pack_cache.get(x, self.weight, self.bias)
            if packed is not None:
                return onednn.linear(x, packed, self.bias)
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype in PADDED_DTYPES:
            return super().forward(torch.cat([x, x]))[:1]
        return super().forward(x)


class FusedLinears:
    """Several :class:`RowInvariantLinear` layers that read the same input (q/k/v, gate/up)
    computed as one product on one prepacked weight, their rows concatenated, then split:
    fewer, larger calls (docs/benchmarks.md, 'Linear layers'; each output equal bit for bit to
    its own layer's on the hosts measured, and row-invariant as the pack checks). The layers
    keep their parameters and state-dict names; where no pack applies (GPU, float64, autograd,
    the first layer's backend without ``prepacked_linear``) each runs on its own. A plain
    object, not a module: the layers stay where they are registered."""

    def __init__(self, *linears: RowInvariantLinear) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self._pack_cache = onednn.PackCache()
        with_bias = [lin.bias is not None for lin in linears]
        self._fusable = all(with_bias) or not any(with_bias)  # a mix runs each on its own
        for lin in linears:
            lin._fused_into = self
        self._blocks: tuple[tuple, BlockWeight] | None = None  # (members' blocks ids, stacked)

    def blocks_for(self, x: torch.Tensor) -> BlockWeight | None:
        """The layers' GGUF blocks stacked into one weight, or None unless every layer has
        blocks for ``x`` in one format (then they run on their packs or alone)."""
        parts = [lin.blocks_for(x) for lin in self.linears]
        if any(p is None for p in parts) or len({p.fmt for p in parts}) != 1:
            return None
        key = tuple(id(p) for p in parts)
        if self._blocks is None or self._blocks[0] != key:
            self._blocks = (key, BlockWeight.cat(parts))
        return self._blocks[1]

    def pack_for(self, x: torch.Tensor) -> torch.Tensor | None:
        """The fused pack for input ``x`` [M, in], or None (run the layers one by one)."""
        if not self._fusable or not self.linears[0].backend.prepacked_linear.on:
            return None
        biases = None if self.linears[0].bias is None else [lin.bias for lin in self.linears]
        return self._pack_cache.get_fused(x, [lin.weight for lin in self.linears], biases)

    def joint(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, in] -> the layers' outputs side by side, [M, sum(out_i)], where they run
        as one product (GGUF blocks or a fused pack); None where they would run one by one.
        Each layer's LoRA deltas (engine/lora.py) are added to its columns."""
        y = self._joint_base(x)
        if y is not None and any(lin._lora is not None for lin in self.linears):
            lo = 0
            for lin, size in zip(self.linears, self.sizes):
                if lin._lora is not None:
                    lin._lora.add_to(x, y, slice(lo, lo + size))
                lo += size
        return y

    def _joint_base(self, x: torch.Tensor) -> torch.Tensor | None:
        blocks = self.blocks_for(x)
        if blocks is not None:
            y = gguf_matmul(x, blocks)
            if all(lin.bias is None for lin in self.linears):
                return y
            return y.add_(torch.cat([lin.bias if lin.bias is not None else
                                     torch.zeros(lin.out_features) for lin in self.linears]))
        packed = self.pack_for(x)
        if packed is None:
            return None
        return onednn.linear(x, packed, self._pack_cache.fused_bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [M, in] -> one [M, out_i] per layer."""
        y = self.joint(x)
        if y is None:
            return tuple(lin(x) for lin in self.linears)
        return y.split(self.sizes, dim=1)


def prepack(model: nn.Module) -> int:
    """Pack every :class:`RowInvariantLinear` of ``model`` for CPU inference now, at load time,
    so the first request does not pay it (SmolLM2: ~0.4 s, packing and the pack checks).
    Returns how many weights were packed (0 on GPU, in float64, or where the layers' backend
    has ``prepacked_linear`` off)."""
    packed = 0
    groups: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RowInvariantLinear):
                if module._blocks is not None or not module.backend.prepacked_linear.on:
                    continue  # on its GGUF blocks (packed only if they are dropped), or no packs
                w = module.weight
                probe = torch.empty(2, module.in_features, dtype=w.dtype, device=w.device)
                group = module._fused_into
                if group is None:
                    packed += module._pack_cache.get(probe, w, module.bias) is not None
                elif id(group) not in groups:  # the group's one pack, not its layers'
                    groups.add(id(group))
                    packed += group.pack_for(probe) is not None
    return packed


__all__ = ["PADDED_DTYPES", "FusedLinears", "RowInvariantLinear", "prepack"]
