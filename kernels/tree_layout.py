"""The token-tree layout shared by the tree verification ops
(docs/architecture.md, 'Verification rules'): the greedy walk
(:mod:`kernels.tree_walk`) and SpecInfer's multi-step speculative sampling
(:mod:`kernels.tree_rejection_sample`).

Layout (the chain rules' ragged layout, vLLM's vocabulary): request ``b`` drafts a tree of
``k_b >= 0`` nodes ``draft_token_ids[s_b : s_b + k_b]`` (``s_b = cu[b-1]``, ``cu[-1]`` read as
0). ``parents[s_b + j]`` is the parent of node ``j`` as a node index within the same request,
``-1`` for the root (the last committed token); ``parents[s_b + j] < j`` (topological order).
Siblings are tried in node-index order. The request has ``k_b + 1`` target rows starting at
``s_b + b``: row 0 is the target after the root, row ``1 + j`` the target after node ``j`` (its
ancestors and itself appended to the committed prefix). A chain of ``k`` nodes
(``parents = [-1, 0, .., k-2]``) has depth ``k`` and is verified exactly as the chain rules
verify it.

Both ops walk the tree from the root, one node per depth (each op's module gives its rule).

Returns of both ops: ``(output_token_ids, accept_len, accepted_node_ids)``: int64
``[batch, max_depth + 1]`` (the accepted path's tokens, then the extra token, padded with
:data:`PLACEHOLDER_TOKEN_ID`), int64 ``[batch]`` (the path's depth, extra token excluded) and
int64 ``[batch, max_depth]`` (the path's node indices within the request, ``-1`` padded), with
``max_depth`` the deepest tree of the batch unless given.

Entry points per op: ``<op>_ref`` (plain torch, the source of truth, any device),
``<op>_triton`` (the kernel: CUDA, or CPU under ``TRITON_INTERPRET=1``) and ``<op>`` (the
launcher: CUDA or TRITON_INTERPRET -> kernel, else reference).

Here: :func:`tree_node_depths`, the check of ``parents`` (:func:`check_parents`), the
references' walk state (:class:`Walk`), the kernels' shared parts (:func:`request_span`,
:func:`store_result`), the result allocation (:func:`allocate_result`) and the launchers'
choice of path (:func:`use_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.ragged import num_drafts as _num_drafts
from specmesh.kernels.ragged import request_span  # re-exported for the tree kernels
from specmesh.kernels.triton_mode import interpret_mode

TreeResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# --------------------------------------------------------------------------------------------
# Tree shape: depths, validation
# --------------------------------------------------------------------------------------------


def tree_node_depths(cu_num_draft_tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node (a child of the root has depth 1), int64 ``[num_draft_total]``, by
    pointer jumping (``ceil(log2(num_draft_total)) + 1`` rounds, no host sync). A parent outside
    ``[-1, j)`` counts as the root (the walks never reach such a node)."""
    device = parents.device
    total = parents.numel()
    counts = _num_drafts(cu_num_draft_tokens)
    start = cu_num_draft_tokens.to(torch.int64) - counts
    req = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts,
                                  output_size=total)
    local = torch.arange(total, device=device) - start[req]
    valid = (parents >= 0) & (parents < local)
    ancestor = torch.where(valid, parents + start[req], -1)  # global index, -1 = the root
    depth = torch.ones(total, dtype=torch.int64, device=device)  # edges from node to ancestor
    for _ in range(max(1, total.bit_length())):
        has = ancestor >= 0
        safe = ancestor.clamp(min=0)
        depth = depth + torch.where(has, depth[safe], 0)
        ancestor = torch.where(has, ancestor[safe], -1)
    return depth


def check_parents(parents: torch.Tensor, draft_token_ids: torch.Tensor,
                  cu_num_draft_tokens: torch.Tensor, max_depth: int | None) -> int:
    """Check ``parents`` (the other inputs are checked) and return ``max_depth`` (computed when
    None: one host sync on CUDA, as the chain rules' max count).

    Raises:
        ValueError: ``parents`` not an int64 1-D tensor of ``num_draft_total`` values on the
            drafts' device; ``max_depth`` not an int >= 0; (CPU) a parent outside ``[-1, j)``
            for node ``j``, or a tree deeper than ``max_depth``.
    """
    if not isinstance(parents, torch.Tensor):
        raise ValueError(f"parents must be a torch.Tensor, got {type(parents).__name__}")
    if parents.dim() != 1 or parents.dtype != torch.int64:
        raise ValueError(f"parents must be a 1-D int64 tensor, got {parents.dtype} "
                         f"{tuple(parents.shape)}")
    if parents.numel() != draft_token_ids.numel():
        raise ValueError(f"parents has {parents.numel()} values, draft_token_ids "
                         f"{draft_token_ids.numel()}")
    if parents.device != draft_token_ids.device:
        raise ValueError(f"parents is on {parents.device}, the drafts on "
                         f"{draft_token_ids.device}")
    if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int)
                                  or max_depth < 0):
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    if parents.is_cuda and max_depth is not None:
        return max_depth
    if parents.numel() == 0:
        return max_depth or 0
    if not parents.is_cuda:
        counts = _num_drafts(cu_num_draft_tokens)
        local = torch.arange(parents.numel()) - torch.repeat_interleave(
            cu_num_draft_tokens.to(torch.int64) - counts, counts)
        bad = (parents < -1) | (parents >= local)
        if bool(bad.any()):
            j = int(bad.nonzero()[0, 0])
            raise ValueError(f"parents[{j}] = {int(parents[j])}: a node's parent must be -1 "
                             f"(the root) or an earlier node of its request (< {int(local[j])})")
    deepest = int(tree_node_depths(cu_num_draft_tokens, parents).max())
    if max_depth is None:
        return deepest
    if deepest > max_depth:
        raise ValueError(f"a tree has depth {deepest} > max_depth={max_depth}")
    return max_depth


# --------------------------------------------------------------------------------------------
# References: the walk state
# --------------------------------------------------------------------------------------------


class Walk:
    """State of every request's walk in the references (one node per depth, scanned in node
    order: a node's children come after it, so one pass over the node indices suffices)."""

    def __init__(self, cu_num_draft_tokens: torch.Tensor, width: int, device: torch.device):
        self.counts = _num_drafts(cu_num_draft_tokens)  # [batch]
        self.start = cu_num_draft_tokens.to(torch.int64) - self.counts  # [batch]
        batch = self.counts.numel()
        self.req = torch.arange(batch, device=device)
        self.node = torch.full((batch,), -1, dtype=torch.int64, device=device)  # -1 = root
        self.row = self.start + self.req  # target row of the current node
        self.depth = torch.zeros(batch, dtype=torch.int64, device=device)
        self.path_tokens = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=torch.int64,
                                      device=device)
        self.path_nodes = torch.full((batch, width), -1, dtype=torch.int64, device=device)

    def children(self, j: int, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(is_child [batch], index [batch])``: whether node ``j`` of each request is a child
        of its current node, and the node's global index (0 where the request has no node j)."""
        has = j < self.counts
        index = torch.where(has, self.start + j, 0)
        return has & (parents[index] == self.node), index

    def move(self, accepted: torch.Tensor, j: int, tokens: torch.Tensor) -> None:
        """Requests where ``accepted`` move to their node ``j`` (token ``tokens``)."""
        if not bool(accepted.any()):
            return
        b = accepted.nonzero()[:, 0]
        self.path_tokens[b, self.depth[b]] = tokens[b]
        self.path_nodes[b, self.depth[b]] = j
        self.node = torch.where(accepted, j, self.node)
        self.row = torch.where(accepted, self.start + self.req + 1 + j, self.row)
        self.depth = self.depth + accepted.to(torch.int64)

    def result(self, extra: torch.Tensor) -> TreeResult:
        out = self.path_tokens.clone()
        out[self.req, self.depth] = extra
        return out, self.depth, self.path_nodes[:, :-1].contiguous()


# --------------------------------------------------------------------------------------------
# Kernels: a request's span, its result
# --------------------------------------------------------------------------------------------


@triton.jit
def store_result(output_ptr, accept_len_ptr, node_ids_ptr, req, output_width, depth, extra,
                 path_tokens, path_nodes, PLACEHOLDER: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write request ``req``'s output row, accept_len and accepted node ids."""
    pos = tl.arange(0, BLOCK_D)
    output = tl.where(pos < depth, path_tokens, tl.where(pos == depth, extra, PLACEHOLDER))
    tl.store(output_ptr + req * output_width + pos, output, mask=pos < output_width)
    tl.store(node_ids_ptr + req * (output_width - 1) + pos, path_nodes,
             mask=pos < output_width - 1)
    tl.store(accept_len_ptr + req, depth)


# --------------------------------------------------------------------------------------------
# Results, launchers
# --------------------------------------------------------------------------------------------


def allocate_result(batch: int, width: int, device: torch.device) -> TreeResult:
    """Uninitialized ``(output_token_ids [batch, width], accept_len [batch],
    accepted_node_ids [batch, width - 1])``, int64 on ``device``."""
    i64 = torch.int64
    return (torch.empty((batch, width), dtype=i64, device=device),
            torch.empty((batch,), dtype=i64, device=device),
            torch.empty((batch, width - 1), dtype=i64, device=device))


def use_kernel(draft_token_ids: object) -> bool:
    """Whether a launcher takes the kernel: CUDA tensors, or ``TRITON_INTERPRET=1``."""
    on_cuda = isinstance(draft_token_ids, torch.Tensor) and draft_token_ids.is_cuda
    return on_cuda or interpret_mode()


__all__ = ["TreeResult", "Walk", "allocate_result", "check_parents", "request_span",
           "store_result", "tree_node_depths", "use_kernel"]
