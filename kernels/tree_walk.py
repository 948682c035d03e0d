"""Greedy tree verification over a ragged batch (docs/architecture.md, 'Verification rules'): the
tree walk, in the layout of
:mod:`kernels.tree_layout` (node numbering, ``parents``, target rows, results); the tree form
of :mod:`kernels.greedy_verify`.

:func:`tree_walk` (greedy, and the coupled rule of seeded requests with its Gumbel-max token
per row): at node ``u`` move to the first child whose token equals the target token of row
``u``; stop when none does. The extra token is the target token of the stop row (the
``bonus_token_id`` at a leaf, else the ``recovered_token_id``).

Entry points: :func:`tree_walk_ref` (plain torch, the source of truth, any device),
:func:`tree_walk_triton` (the kernel: CUDA, or CPU under ``TRITON_INTERPRET=1``) and
:func:`tree_walk` (the launcher: CUDA or TRITON_INTERPRET -> kernel, else reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.greedy_verify import _validate as _validate_greedy
from specmesh.kernels.tree_layout import (
    TreeResult,
    Walk,
    allocate_result,
    check_parents,
    request_span,
    store_result,
    use_kernel,
)
from specmesh.kernels.triton_mode import check_runnable, is_interpreted


def _validate_walk(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                   parents: torch.Tensor, target_token_ids: torch.Tensor,
                   max_depth: int | None) -> int:
    """The greedy chain rule's checks, then :func:`kernels.tree_layout.check_parents`; returns
    ``max_depth``."""
    _validate_greedy(draft_token_ids, cu_num_draft_tokens, target_token_ids, None)
    return check_parents(parents, draft_token_ids, cu_num_draft_tokens, max_depth)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def tree_walk_ref(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    target_token_ids: torch.Tensor,
    max_depth: int | None = None,
) -> TreeResult:
    """Greedy tree walk in plain torch (the source of truth). See the module docstring.

    Args:
        draft_token_ids: int64 ``[num_draft_total]``, every request's tree nodes, concatenated.
        cu_num_draft_tokens: int32/int64 ``[batch]``, inclusive cumsum of the node counts.
        parents: int64 ``[num_draft_total]``, each node's parent within its request (-1: root).
        target_token_ids: int64 ``[num_draft_total + batch]``, the target's token per row
            (argmax, or the coupled rule's Gumbel-max token), ``k_b + 1`` rows per request.
        max_depth: output width minus one; the deepest tree when None.

    Returns:
        ``(output_token_ids [batch, max_depth + 1], accept_len [batch],
        accepted_node_ids [batch, max_depth])``, int64.

    Raises:
        ValueError: see :func:`kernels.greedy_verify._validate` and
            :func:`kernels.tree_layout.check_parents`.
    """
    width = _validate_walk(draft_token_ids, cu_num_draft_tokens, parents, target_token_ids,
                           max_depth) + 1
    device = draft_token_ids.device
    if cu_num_draft_tokens.numel() == 0:
        return allocate_result(0, width, device)
    walk = Walk(cu_num_draft_tokens, width, device)
    for j in range(int(walk.counts.max())):
        child, index = walk.children(j, parents)
        tokens = draft_token_ids[index]
        walk.move(child & (tokens == target_token_ids[walk.row]), j, tokens)
    return walk.result(target_token_ids[walk.row])


# --------------------------------------------------------------------------------------------
# Triton kernel, entry and launcher
# --------------------------------------------------------------------------------------------


@triton.jit
def _tree_walk_kernel(
    draft_ptr,  # int64 [num_draft_total]
    cu_ptr,  # int32/int64 [batch]
    parents_ptr,  # int64 [num_draft_total]
    target_ptr,  # int64 [num_draft_total + batch]
    output_ptr,  # int64 [batch, output_width]
    accept_len_ptr,  # int64 [batch]
    node_ids_ptr,  # int64 [batch, output_width - 1]
    output_width,  # max_depth + 1
    PLACEHOLDER: tl.constexpr,
    BLOCK_D: tl.constexpr,  # power of two >= output_width
):
    """One program per request: one pass over its nodes in index order, moving to a child of
    the current node whose token is the current row's target token."""
    req = tl.program_id(0).to(tl.int64)
    start, count = request_span(cu_ptr, req)
    pos = tl.arange(0, BLOCK_D)
    node = tl.full([], -1, tl.int64)
    row = start + req
    depth = tl.zeros([], tl.int64)
    path_tokens = tl.full([BLOCK_D], PLACEHOLDER, tl.int64)
    path_nodes = tl.full([BLOCK_D], -1, tl.int64)
    for i in range(start, start + count):  # global node index (a Python int when interpreted)
        j = i - start  # within-request node index, an int64 scalar tensor
        parent = tl.load(parents_ptr + i)
        token = tl.load(draft_ptr + i)
        hit = (parent == node) & (token == tl.load(target_ptr + row))
        path_tokens = tl.where(hit & (pos == depth), token, path_tokens)
        path_nodes = tl.where(hit & (pos == depth), j, path_nodes)
        node = tl.where(hit, j, node)
        row = tl.where(hit, i + req + 1, row)
        depth += hit.to(tl.int64)
    store_result(output_ptr, accept_len_ptr, node_ids_ptr, req, output_width, depth,
                 tl.load(target_ptr + row), path_tokens, path_nodes, PLACEHOLDER, BLOCK_D)


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_tree_walk_kernel)


def tree_walk_triton(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    target_token_ids: torch.Tensor,
    max_depth: int | None = None,
) -> TreeResult:
    """:func:`tree_walk_ref` computed by the Triton kernel (same arguments and results).

    Raises:
        ValueError: as :func:`tree_walk_ref`; or CPU tensors while the kernel is compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
    """
    width = _validate_walk(draft_token_ids, cu_num_draft_tokens, parents, target_token_ids,
                           max_depth) + 1
    check_runnable(draft_token_ids.is_cuda, _tree_walk_kernel)
    batch = cu_num_draft_tokens.numel()
    output, accept_len, node_ids = allocate_result(batch, width, draft_token_ids.device)
    if batch:
        _tree_walk_kernel[(batch,)](
            draft_token_ids.contiguous(), cu_num_draft_tokens.contiguous(), parents.contiguous(),
            target_token_ids.contiguous(), output, accept_len, node_ids, width,
            PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK_D=triton.next_power_of_2(width), num_warps=1,
            enable_fp_fusion=False,
        )
    return output, accept_len, node_ids


def tree_walk(
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    parents: torch.Tensor,
    target_token_ids: torch.Tensor,
    max_depth: int | None = None,
) -> TreeResult:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else the
    torch reference. Arguments, results and errors as :func:`tree_walk_ref` (plus the
    RuntimeError of :func:`tree_walk_triton`)."""
    fn = tree_walk_triton if use_kernel(draft_token_ids) else tree_walk_ref
    return fn(draft_token_ids, cu_num_draft_tokens, parents, target_token_ids, max_depth)


__all__ = ["tree_walk", "tree_walk_ref", "tree_walk_triton"]
