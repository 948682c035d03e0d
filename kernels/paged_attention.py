"""Paged attention over a ragged batch: every request's queries read its K/V from the paged
cache through its block table, in one batched op (no per-request loop) (DESIGN.md §11).

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
- :func:`paged_attention_triton`: the Triton kernel (CUDA tensors, or CPU under
  ``TRITON_INTERPRET=1``, set before triton is imported);
- :func:`paged_attention`: the launcher (CUDA or interpreter → kernel, else the reference).

Shapes: ``q`` [T, H, D] (T = sum(query_lens)); ``k_cache``/``v_cache`` [num_blocks,
block_size, Hkv, D]; ``block_tables`` int [B, max_blocks] (entries past a request's last block
are ignored, pad with any valid id); ``query_lens``, ``kv_lens`` int [B]; ``scale`` the softmax
scale (usually D ** -0.5). Returns [T, H, D] in q's dtype. The reference computes scores,
softmax and the value product in float32 (float64 for a float64 model) from the exact upcast
inputs and rounds once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention_plan import PagedAttentionPlan, plan_paged_attention, tile_len
from kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

#: Matmuls with fewer rows than this take another BLAS kernel (measured on this machine type:
#: fp32 rows of an M <= 3 product differ in the last bit from the same rows in a larger M), so
#: the reference pads the query rows of every KV head to at least this many.
MIN_MATMUL_ROWS = 4


def _check_tensors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [T, H, D] and k_cache == v_cache [blocks, block_size, Hkv, D]"
                         f", got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"head_dim {q.shape[2]} vs {k_cache.shape[3]}, or {q.shape[1]} query "
                         f"heads not a multiple of {k_cache.shape[2]} KV heads")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")


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
    _check_tensors(q, k_cache, v_cache)
    num_blocks, block_size, hkv, d = k_cache.shape
    if plan is None:
        plan = plan_paged_attention(query_lens, kv_lens, block_tables, block_size, q.device,
                                    tree_masks)
    t, h, _ = q.shape
    if plan.token_batch.numel() != t:
        raise ValueError(f"q has {t} rows, query_lens sum to {plan.token_batch.numel()}")
    if plan.block_size != block_size:
        raise ValueError(f"plan built for block size {plan.block_size}, cache has {block_size}")
    b, g = plan.block_tables.shape[0], h // hkv
    tile = tile_len(block_size)
    n_tiles = plan.n_blocks * block_size // tile
    q_pad = max(plan.q_max, -(-MIN_MATMUL_ROWS // g))
    rows = g * q_pad
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    # each request's tiles, [B, Hkv, n_tiles, tile, D], in the accumulation dtype (one gather)
    def tiles(cache: torch.Tensor) -> torch.Tensor:
        x = cache.index_select(0, plan.block_tables.view(-1))
        x = x.view(b, n_tiles, tile, hkv, d).permute(0, 3, 1, 2, 4)
        return x.to(dtype=acc, memory_format=torch.contiguous_format)

    k, v = tiles(k_cache), tiles(v_cache)
    padded = not (q_pad == plan.q_max and t == b * q_pad)
    if not padded:  # every request has q_max rows: no padding
        qp = q.view(b, q_pad, h, d)
    else:
        qp = q.new_zeros((b, q_pad, h, d))
        qp[plan.token_batch, plan.token_row] = q
    # [B, Hkv, 1, G * q_pad, D]: query head h = kv_head * G + g
    qp = qp.view(b, q_pad, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, 1, rows, d)
    qp = qp.to(acc) * scale
    scores = torch.matmul(qp, k.transpose(-1, -2))  # [B, Hkv, nt, rows, tile]
    pairs = None
    if plan.path_tiles is not None:  # tree rows: the tiles holding their paths, in order
        pairs = _PathTiles(plan, qp, k_cache, v_cache, g, q_pad, acc)
        pairs.put(scores, torch.matmul(pairs.q, pairs.k.transpose(-1, -2)))
    scores = scores.view(b, hkv, n_tiles, g, q_pad, tile)
    scores.masked_fill_(~plan.tile_mask(q_pad), float("-inf"))
    e = scores.sub_(scores.amax(dim=(2, 5), keepdim=True)).exp_()
    # sums over positions: within a tile (fixed shape), then tile by tile in order (cumsum)
    den = e.sum(-1).cumsum(2)[:, :, -1]  # [B, Hkv, G, q_pad]
    e = e.view(b, hkv, n_tiles, rows, tile)
    num = torch.matmul(e, v)  # [B, Hkv, nt, rows, D]
    if pairs is not None:
        pairs.put(num, torch.matmul(pairs.take(e), pairs.v))
    num = num.cumsum(2)[:, :, -1]
    out = num.view(b, hkv, g, q_pad, d) / den[..., None]
    out = out.permute(0, 3, 1, 2, 4).reshape(b, q_pad, h, d)
    out = out[plan.token_batch, plan.token_row] if padded else out.reshape(t, h, d)
    return out.to(q.dtype)


class _PathTiles:
    """The reference's (tree row, KV tile) pairs of ``plan.path_tiles``: each pair's query
    heads and its tile's K/V with the row's path rows in order (where one-token decode steps
    along the path would have written them), so the pair's scores and value product come from
    the same values in the same places as in those steps. Products pad their rows to
    MIN_MATMUL_ROWS with copies of the pair's first head (dropped after)."""

    def __init__(self, plan: PagedAttentionPlan, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, g: int, q_pad: int, acc: torch.dtype) -> None:
        req, row, self.tile, slots = plan.path_tiles
        key = ("path_rows", g, q_pad)
        rows = plan._masks.get(key)
        if rows is None:  # [P, max(G, MIN_MATMUL_ROWS)]: the pair's rows among G * q_pad
            heads = torch.arange(max(g, MIN_MATMUL_ROWS), device=row.device)
            rows = plan._masks[key] = heads.masked_fill(heads >= g, 0) * q_pad + row[:, None]
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
) -> torch.Tensor:
    """Launcher: the Triton kernel on CUDA (or on CPU under ``TRITON_INTERPRET=1``), else
    :func:`paged_attention_ref`. Arguments, result and errors as the reference (plus the
    kernel's, see :func:`paged_attention_triton`)."""
    kernel = _triton_entry()
    if kernel is not None and (q.is_cuda or _interpret_mode()):
        return kernel(q, k_cache, v_cache, block_tables, query_lens, kv_lens, scale, plan,
                      tree_masks)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_lens, kv_lens, scale,
                               plan, tree_masks)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Fixed tile of KV positions: launch parameters depend only on the model (heads, head_dim,
# dtype), never on the batch, so a row's reduction order is the same in every step.
_BLOCK_N = 64


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, H, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, H, D], contiguous
    tables_ptr,  # int64 [B, n_blocks]
    token_batch_ptr,  # int [T]: request of each query token
    token_visible_ptr,  # int [T]: positions each query token sees (n - q + j + 1)
    path_ptr,  # int32 [T, w]: chunk row each query token reads at chunk offset o (HAS_TREE)
    chunk_start_ptr,  # int32 [T]: position of the token's chunk row 0, n - q (HAS_TREE only)
    scale,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh,
    stride_tb,
    stride_mt,
    block_size,
    head_dim,
    HAS_TREE: tl.constexpr,  # some request of the batch has a token tree
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # power of two >= max(GROUP, 16)
    BLOCK_N: tl.constexpr,  # KV positions per tile, power of two >= 16
    BLOCK_D: tl.constexpr,  # power of two >= max(head_dim, 16)
    ACC_DTYPE: tl.constexpr,  # float32, or float64 for a float64 model
    DOT_FP32: tl.constexpr,  # feed tl.dot float32 (the interpreter's dot misreads bfloat16)
):
    """One program per (query token, KV head): the GROUP query heads that read this KV head,
    over the token's visible positions in tiles of BLOCK_N, with an online softmax. With
    HAS_TREE, chunk offset o reads chunk row path[o] (a tree row's path, at consecutive
    positions as in one-token decode steps along it)."""
    tok = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    req = tl.load(token_batch_ptr + tok).to(tl.int64)
    n_vis = tl.load(token_visible_ptr + tok).to(tl.int32)
    if HAS_TREE:
        c_start = tl.load(chunk_start_ptr + tok).to(tl.int32)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < head_dim
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), ACC_DTYPE)
    l_i = tl.zeros([BLOCK_G], ACC_DTYPE)
    acc = tl.zeros([BLOCK_G, BLOCK_D], ACC_DTYPE)
    for start in range(0, n_vis, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        p_mask = pos < n_vis
        src = pos
        if HAS_TREE:  # the chunk part: the token's path rows, in depth order
            in_chunk = p_mask & (pos >= c_start)
            row = tl.load(path_ptr + tok * stride_mt + (pos - c_start), mask=in_chunk, other=0)
            src = tl.where(in_chunk, c_start + row, pos)
        blk = tl.load(tables_ptr + req * stride_tb + src // block_size, mask=p_mask,
                      other=0).to(tl.int64)
        off = (src % block_size).to(tl.int64)
        kv_mask = p_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks
                    + kvh * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        # scores rounded to the model dtype (as the reference's and eager attention's matmul),
        # then scaled and softmaxed in ACC_DTYPE
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee",
                       out_dtype=ACC_DTYPE)
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC_DTYPE)
        s = s.to(q.dtype).to(ACC_DTYPE) * scale
        s = tl.where(p_mask[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the first tile sees position 0
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
                    + kvh * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        # probabilities cast to the model dtype before the value product (as the reference)
        p = p.to(v.dtype)
        if DOT_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee",
                        out_dtype=ACC_DTYPE)
        else:
            pv = tl.dot(p, v, input_precision="ieee", out_dtype=ACC_DTYPE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def _interpret_mode() -> bool:
    """See :func:`kernels.triton_mode.interpret_mode`."""
    return interpret_mode()


def _kernel_is_interpreted() -> bool:
    """Whether this module's kernel was decorated interpreted (see :mod:`kernels.triton_mode`)."""
    return is_interpreted(_paged_attention_kernel)


def paged_attention_triton(
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
    """:func:`paged_attention_ref` computed by the Triton kernel (same arguments and result).

    One program per (query token, KV head) covers that KV head's group of query heads and loops
    over the token's visible positions in fixed tiles (online softmax, float32 accumulator;
    float64 for float64): a row's result depends on nothing else in the batch, bit for bit.

    Raises:
        ValueError: as :func:`paged_attention_ref`; a dtype other than float16/bfloat16/
            float32/float64; tensors (or the plan's) on different devices; block ids out of
            range (checked for CPU tensors only); CPU tensors while the kernel is compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
    """
    _check_tensors(q, k_cache, v_cache)
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel supports float16/bfloat16/float32/float64, got {q.dtype}")
    devices = {q.device, k_cache.device, v_cache.device}
    if len(devices) != 1:
        raise ValueError(f"q, k_cache, v_cache are on different devices: "
                         f"{sorted(map(str, devices))}")
    num_blocks, block_size, hkv, d = k_cache.shape
    if plan is None:
        plan = plan_paged_attention(query_lens, kv_lens, block_tables, block_size, q.device,
                                    tree_masks)
    t, h, _ = q.shape
    if plan.token_batch.numel() != t:
        raise ValueError(f"q has {t} rows, query_lens sum to {plan.token_batch.numel()}")
    token_visible = plan.token_visible
    if token_visible is None:  # a plan built by hand: count each token's visible positions
        token_visible = plan.num_visible[plan.token_batch, plan.token_row]
    has_tree = plan.token_path is not None
    tree_rows = plan.token_path if has_tree else token_visible
    chunk_start = plan.token_chunk_start if has_tree else token_visible
    plan_tensors = (plan.token_batch, token_visible, plan.block_tables, tree_rows, chunk_start)
    if any(x.device != q.device for x in plan_tensors):
        raise ValueError(f"the plan's tensors must be on {q.device}, got "
                         f"{sorted({str(x.device) for x in plan_tensors})}")
    check_runnable(q.is_cuda, _paged_attention_kernel)
    if not q.is_cuda:
        if plan.block_tables.numel() and not (
                0 <= int(plan.block_tables.min()) and int(plan.block_tables.max()) < num_blocks):
            raise ValueError(f"block_tables hold ids outside [0, {num_blocks})")
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0 or h == 0:
        return out
    tables = plan.block_tables
    if tables.dtype != torch.int64 or tables.stride(-1) != 1:
        tables = tables.to(torch.int64).contiguous()
    group = h // hkv
    _paged_attention_kernel[(t, hkv)](
        q, k_cache, v_cache, out, tables, plan.token_batch, token_visible, tree_rows,
        chunk_start, float(scale),
        *q.stride(), *k_cache.stride(), *v_cache.stride(), out.stride(0), out.stride(1),
        tables.stride(0), tree_rows.stride(0), block_size, d,
        HAS_TREE=has_tree, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        ACC_DTYPE=tl.float64 if q.dtype == torch.float64 else tl.float32,
        # triton's interpreter multiplies bfloat16 dot operands as their raw uint16 bits; the
        # products of bfloat16 values are exact in float32, so only the summation order differs
        DOT_FP32=q.dtype == torch.bfloat16 and _kernel_is_interpreted(),
        num_warps=4,
    )
    return out


def _triton_entry():  # noqa: ANN202
    """The Triton entry point (looked up at call time, so tests may replace it)."""
    return paged_attention_triton


__all__ = ["MIN_MATMUL_ROWS", "paged_attention", "paged_attention_ref",
           "paged_attention_triton"]
