"""The Triton kernel of :mod:`kernels.paged_attention` (same arguments and result as its
reference; batch layout, trees and batch invariance as documented there and in
:mod:`kernels.paged_attention_plan`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specmesh.kernels.paged_attention_plan import PagedAttentionPlan, check_block_ids, resolve_plan
from specmesh.kernels.triton_mode import check_runnable, interpret_mode, is_interpreted

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
            float32/float64, or a cache of another dtype than q's (a 16-bit KV cache of a
            float32 model runs on the CPU only); tensors (or the plan's) on different
            devices; block ids out of range (checked for CPU tensors only); CPU tensors while
            the kernel is compiled.
        RuntimeError: CPU tensors with ``TRITON_INTERPRET=1`` set only after triton was
            imported (the kernel was already decorated for compilation).
    """
    if q.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"the kernel supports float16/bfloat16/float32/float64, got {q.dtype}")
    devices = {q.device, k_cache.device, v_cache.device}
    if len(devices) != 1:
        raise ValueError(f"q, k_cache, v_cache are on different devices: "
                         f"{sorted(map(str, devices))}")
    plan = resolve_plan(q, k_cache, v_cache, block_tables, query_lens, kv_lens, plan,
                        tree_masks)
    if k_cache.dtype != q.dtype:
        raise ValueError(f"the Triton kernel reads a cache of q's dtype only, got q {q.dtype} "
                         f"over {k_cache.dtype}")
    num_blocks, block_size, hkv, d = k_cache.shape
    t, h, _ = q.shape
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
        check_block_ids(plan, num_blocks)
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


__all__ = ["paged_attention_triton"]
