"""Paged attention over a ragged batch: every request's queries read its K/V from the paged
cache through its block table, in one batched op (no per-request loop)
(docs/architecture.md, 'Batch invariance').

The batch's layout (query rows, KV lengths, block tables, the bottom-right causal mask,
grouped-query heads) and the token trees' ancestry masks are those of
:mod:`kernels.paged_attention_plan`, whose :class:`PagedAttentionPlan` carries them.

Batch invariance: the result of one query row depends only on that row, the positions it
sees, and the cache; not on how many rows its request has in this step, on the other requests
of the batch, or on how far the batch is padded. So a verify step over ``[last token] +
drafts`` computes, for each row, bit for bit what a one-token decode step at that position
computes, and bf16 (and fp32) output with speculation equals output without it. The reference
gets this from the shapes of its matmuls: positions are reduced in fixed tiles of
:func:`tile_len` positions (one fixed-shape product per tile), tiles are added in order
(``cumsum``), padding adds whole tiles of exact zeros, and every product has at least
:data:`MIN_MATMUL_ROWS` rows; tests check the property on this machine's BLAS. The Triton
kernel gets it by construction (one program per query row and KV head, a fixed loop over KV
tiles).

Entry points, one signature:
- :func:`paged_attention_ref`: plain torch, the source of truth (any device);
- :func:`paged_attention_triton`: the Triton kernel (:mod:`kernels.paged_attention_triton`;
  CUDA tensors, or CPU under ``TRITON_INTERPRET=1``, set before triton is imported);
- :func:`kernels.cpu_attention.paged_attention_cpu`: compiled C++ for the CPU (built on first
  use; equal to the reference up to float rounding, batch invariant by construction);
- :func:`paged_attention`: the launcher (CUDA or interpreter → Triton kernel; CPU → the C++
  kernel when the caller's backend uses it (``cpu_kernel``) and it could be built, else the
  reference).

Shapes: ``q`` [T, H, D] (T = sum(query_lens)); ``k_cache``/``v_cache`` [num_blocks,
block_size, Hkv, D]; ``block_tables`` int [B, max_blocks] (entries past a request's last block
are ignored, pad with any valid id); ``query_lens``, ``kv_lens`` int [B]; ``scale`` the softmax
scale (usually D ** -0.5). Returns [T, H, D] in q's dtype. The reference computes scores,
softmax and the value product in float32 (float64 for a float64 model) from the exact upcast
inputs and rounds once at the end. The cache is in q's dtype or, for float32 queries, in
bfloat16 or float16 (a 16-bit KV cache, ``--kv-cache-dtype``; see
:data:`~kernels.paged_attention_plan.NARROW_KV_DTYPES`): its K/V are widened exactly, so
batch invariance and everything above hold as they do for a float32 cache.
"""

from __future__ import annotations

import torch

from specmesh.kernels import cpu_attention
from specmesh.kernels.paged_attention_plan import (
    MIN_MATMUL_ROWS,
    PagedAttentionPlan,
    resolve_plan,
    tile_len,
)
from specmesh.kernels.paged_attention_triton import (  # noqa: F401 (the kernel's entry, re-exported)
    _interpret_mode,
    _kernel_is_interpreted,
    paged_attention_triton,
)



def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | list[list[int]],
    query_lens: torch.Tensor | list[int],
    kv_lens: torch.Tensor | list[int],
    scale: float,
    plan: PagedAttentionPlan | None = None,
    tree_masks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Attention of every query row over its visible cached positions (see the module doc and
    :mod:`kernels.paged_attention_plan`).

    ``plan`` (from :func:`plan_paged_attention` with the same lengths and tables) saves
    rebuilding the index tensors in every layer. ``tree_masks`` (per request None or a bool
    ``[q, q]`` ancestry mask, see :mod:`kernels.paged_attention_plan`) is used only to build
    the plan when none is given (a plan carries its batch's masks).

    Returns:
        [T, H, D] in ``q.dtype``.

    Raises:
        ValueError: see :func:`plan_paged_attention`; shapes or dtypes that do not match, or
            ``T != sum(query_lens)``.
    """
    plan = resolve_plan(q, k_cache, v_cache, block_tables, query_lens, kv_lens, plan,
                        tree_masks)
    _, block_size, hkv, d = k_cache.shape
    t, h, _ = q.shape
    b, g, q_max = plan.block_tables.shape[0], h // hkv, plan.q_max
    tile = tile_len(block_size)
    n_tiles = plan.n_blocks * block_size // tile
    # per KV head, the query rows of its G heads (row gi * q_max + j: head gi, chunk row j),
    # then zero rows up to MIN_MATMUL_ROWS
    real = g * q_max
    rows = plan.num_rows(g)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # each request's tiles, [B, Hkv, n_tiles, tile, D], in the accumulation dtype (one gather)
    def tiles(cache: torch.Tensor) -> torch.Tensor:
        x = cache.index_select(0, plan.block_tables.view(-1))
        x = x.view(b, n_tiles, tile, hkv, d).permute(0, 3, 1, 2, 4)
        return x.to(dtype=acc, memory_format=torch.contiguous_format)

    k, v = tiles(k_cache), tiles(v_cache)
    ragged = t != b * q_max
    if not ragged:  # every request has q_max rows
        qp = q.view(b, q_max, h, d)
    else:
        qp = q.new_zeros((b, q_max, h, d))
        qp[plan.token_batch, plan.token_row] = q
    qp = qp.view(b, q_max, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, real, d)
    if rows > real:
        qp = torch.cat([qp, qp.new_zeros((b, hkv, rows - real, d))], 2)
    qp = (qp.to(acc) * scale)[:, :, None]  # [B, Hkv, 1, rows, D]
    scores = torch.matmul(qp, k.transpose(-1, -2))  # [B, Hkv, nt, rows, tile]
    pairs = None
    if plan.path_tiles is not None:  # tree rows: the tiles holding their paths, in order
        pairs = _PathTiles(plan, qp, k_cache, v_cache, g, acc)
        pairs.put(scores, torch.matmul(pairs.q, pairs.k.transpose(-1, -2)))
    scores.masked_fill_(~plan.row_mask(g), float("-inf"))
    e = scores.sub_(scores.amax(dim=(2, 4), keepdim=True)).exp_()
    # sums over positions: within a tile (fixed shape), then tile by tile in order (cumsum)
    den = e.sum(-1).cumsum(2)[:, :, -1]  # [B, Hkv, rows]
    num = torch.matmul(e, v)  # [B, Hkv, nt, rows, D]
    if pairs is not None:
        pairs.put(num, torch.matmul(pairs.take(e), pairs.v))
    num = num.cumsum(2)[:, :, -1]
    out = (num / den[..., None])[:, :, :real]
    out = out.view(b, hkv, g, q_max, d).permute(0, 3, 1, 2, 4).reshape(b, q_max, h, d)
    out = out[plan.token_batch, plan.token_row] if ragged else out.reshape(t, h, d)
    return out.to(q.dtype)


class _PathTiles:
    """The reference's (tree row, KV tile) pairs of ``plan.path_tiles``: each pair's query
    heads and its tile's K/V with the row's path rows in order (where one-token decode steps
    along the path would have written them), so the pair's scores and value product come from
    the same values in the same places as in those steps. Products pad their rows to
    MIN_MATMUL_ROWS with copies of the pair's first head (dropped after)."""

    def __init__(self, plan: PagedAttentionPlan, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, g: int, acc: torch.dtype) -> None:
        req, row, self.tile, slots = plan.path_tiles
        key = ("path_rows", g)
        rows = plan._masks.get(key)
        if rows is None:  # [P, max(G, MIN_MATMUL_ROWS)]: the pair's rows among G * q_max
            heads = torch.arange(max(g, MIN_MATMUL_ROWS), device=row.device)
            rows = heads.masked_fill(heads >= g, 0) * plan.q_max + row[:, None]
            plan._masks[key] = rows
        self.req, self.rows, self.g = req[:, None], rows, g
        hkv, d = k_cache.shape[2], k_cache.shape[3]

        def tiles(cache: torch.Tensor) -> torch.Tensor:  # [P, Hkv, tile, D]
            x = cache.view(-1, hkv, d).index_select(0, slots)
            return x.view(req.shape[0], -1, hkv, d).transpose(1, 2).to(acc)

        self.k, self.v = tiles(k_cache), tiles(v_cache)
        self.q = self.take(q)  # q [B, Hkv, 1, rows, D] -> [P, Hkv, G', D]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The pairs' rows of ``x`` [B, Hkv, nt, rows, *] (their own tile; nt may be 1, then
        broadcast) as [P, Hkv, G', *]."""
        tile = self.tile[:, None] if x.shape[2] > 1 else 0
        return x[self.req, :, tile, self.rows].transpose(1, 2)

    def put(self, x: torch.Tensor, values: torch.Tensor) -> None:
        """Write the pairs' rows (the first G of ``values`` [P, Hkv, G', *]) into ``x``."""
        x[self.req, :, self.tile[:, None], self.rows[:, :self.g]] = \
            values[:, :, :self.g].transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | list[list[int]],
    query_lens: torch.Tensor | list[int],
    kv_lens: torch.Tensor | list[int],
    scale: float,
    plan: PagedAttentionPlan | None = None,
    tree_masks: list[torch.Tensor | None] | None = None,
    cpu_kernel: bool = True,
) -> torch.Tensor:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``); on the
    CPU the compiled kernel of :mod:`kernels.cpu_attention` where ``cpu_kernel`` (the
    caller's backend choice, engine/backend.py ``cpu_attention``) and the kernel is available
    for q's dtype and the cache's; else :func:`paged_attention_ref`. Arguments, result and
    errors as the reference (plus the kernels', see :func:`paged_attention_triton`). A cache
    narrower than q (a 16-bit KV cache of a float32 model) never goes to the Triton kernel,
    which reads q's dtype only."""
    kernel = _triton_entry()
    if kernel is not None and (q.is_cuda or _interpret_mode()) and k_cache.dtype == q.dtype:
        return kernel(q, k_cache, v_cache, block_tables, query_lens, kv_lens, scale, plan,
                      tree_masks)
    if cpu_kernel and cpu_attention.supports(q, kv_dtype=k_cache.dtype):
        return cpu_attention.paged_attention_cpu(q, k_cache, v_cache, block_tables, query_lens,
                                                 kv_lens, scale, plan, tree_masks)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_lens, kv_lens, scale,
                               plan, tree_masks)


def attention_runs_compiled(q: torch.Tensor, cpu_kernel: bool = True, *,
                            kv_dtype: torch.dtype | None = None) -> bool:
    """Whether :func:`paged_attention` with ``cpu_kernel`` would run ``q`` (or a tensor of
    its dtype and device) over a cache of ``kv_dtype`` (None: q's dtype) on the compiled CPU
    kernel (:mod:`kernels.cpu_attention`), as code that calls that kernel itself must check to
    keep the same path."""
    kv_dtype = q.dtype if kv_dtype is None else kv_dtype
    kernel = _triton_entry()
    if kernel is not None and (q.is_cuda or _interpret_mode()) and kv_dtype == q.dtype:
        return False
    return cpu_kernel and cpu_attention.supports(q, kv_dtype=kv_dtype)


def _triton_entry():  # noqa: ANN202
    """The Triton entry point (looked up at call time, so tests may replace it)."""
    return paged_attention_triton


__all__ = ["MIN_MATMUL_ROWS", "attention_runs_compiled", "paged_attention",
           "paged_attention_ref", "paged_attention_triton"]
