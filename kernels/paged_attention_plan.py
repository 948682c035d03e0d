"""The plan of a paged-attention batch (:mod:`kernels.paged_attention`,
docs/architecture.md, 'Batch invariance'): the
index tensors of one ragged batch, built once per forward and shared by every layer, and the
reference's KV tiling.

Request ``b`` has ``query_lens[b] = q`` query rows (its rows of ``q`` follow request ``b-1``'s)
and ``kv_lens[b] = n`` cached positions, the last ``q`` of which are its queries' own K/V (the
caller writes them before attending). Query row ``j`` sees positions ``p < n - q + j + 1``:
the causal mask aligned bottom-right, as a verify chunk needs (torch SDPA's ``is_causal`` aligns
top-left when q != n, which is silently wrong here). Position ``p`` of request ``b`` lives at
``k_cache[block_tables[b, p // block_size], p % block_size]``. Grouped-query attention: query
head ``h`` reads KV head ``h // (H // Hkv)`` (the Llama / transformers convention).

Token trees (tree verification, SpecInfer arXiv 2305.09781): ``tree_masks`` gives a request a
bool ``[q, q]`` ancestry mask over its own chunk, ``mask[j, c]`` = row ``j`` sees chunk row
``c`` (position ``n - q + c``). Row ``j`` then sees the positions before the chunk and the
chunk rows its mask allows (its ancestors and itself). A mask must be lower-triangular with a
true diagonal and a true column 0 (the root, the last committed token, is every node's
ancestor); a chain's mask is the lower triangle, and requests without one (None) take exactly
the chain path above, bit for bit. Where those rows lie does not show in the result: row ``j``
reads its path (the rows its mask allows, in order) as if they lay at consecutive positions
``n - q, n - q + 1, ...``, as the one-token decode steps along that path would have written
them. Reading them in place instead (a side branch's rows skip branch 0's, masked out) puts
the same values in other places of a reduction and changes the last bit: enough to flip a
near-tie, so output with tree speculation differed from output without it (bf16, seen on one
of 12 held-out chat prompts).

Tiling: the reference reduces positions in fixed tiles of :func:`tile_len` positions (the
batch invariance of :mod:`kernels.paged_attention`); a plan pads every request's block table
to whole tiles.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

_INT_DTYPES = (torch.int32, torch.int64)


#: Positions per KV tile of the reference: the reductions over positions run tile by tile with
#: a fixed tile shape, so padding a request's KV (a longer chunk, a longer batch) only adds
#: whole tiles of exact zeros. A multiple of the block size near 64 (see :func:`tile_len`).
TILE_TOKENS = 64

#: Matmuls with fewer rows than this take another BLAS kernel (on the development CPUs fp32
#: rows of an M <= 3 product differ in the last bit from the same rows in a larger M), so
#: the reference pads the query rows of every KV head to at least this many.
MIN_MATMUL_ROWS = 4


def tile_len(block_size: int) -> int:
    """KV tile length (positions) of the reference for ``block_size``: the largest multiple of
    the block size <= :data:`TILE_TOKENS` (the block size itself when larger)."""
    return block_size * max(1, TILE_TOKENS // block_size)


@dataclass(frozen=True)
class PagedAttentionPlan:
    """Index tensors of one ragged batch, built once per forward and shared by every layer.

    ``token_batch``/``token_row`` long [T]: the request and the row within it of each query
    token; ``num_visible`` long [B, q_max]: positions row j of request b sees
    (``n - q + j + 1``); ``token_visible`` int32 [T]: the same per query token (what the Triton
    kernel reads); ``block_tables`` long [B, n_blocks]: the blocks read, padded to whole KV
    tiles (``n_blocks * block_size`` is a multiple of :func:`tile_len`).
    """

    token_batch: torch.Tensor
    token_row: torch.Tensor
    num_visible: torch.Tensor
    block_tables: torch.Tensor
    q_max: int
    n_blocks: int
    token_visible: torch.Tensor | None = None
    block_size: int = 0
    #: token trees (None without any): ``token_path`` int32 [T, w], per query token the chunk
    #: row it reads at chunk offset ``o`` (its ancestors, then itself, in depth order; the
    #: identity for chain rows), and ``token_chunk_start`` int32 [T], the position of its
    #: request's chunk row 0; what the Triton kernel reads
    token_path: torch.Tensor | None = None
    token_chunk_start: torch.Tensor | None = None
    #: the same for the reference: ``(request, row, tile, slots)``, long [P] x 3 and
    #: [P * tile]: the (query row, KV tile) pairs where a tree row's path lies out of place,
    #: and per slot of that tile the cache slot (``block * block_size + offset``) whose K/V
    #: the row reads there (None: no such pair)
    path_tiles: tuple[torch.Tensor, ...] | None = None
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    def num_rows(self, g: int) -> int:
        """Query rows per KV head in the reference's products: its ``g`` heads' chunk rows
        (``g * q_max``), padded to :data:`MIN_MATMUL_ROWS`."""
        return max(g * self.q_max, MIN_MATMUL_ROWS)

    def row_mask(self, g: int) -> torch.Tensor:
        """bool [B, 1, n_tiles, rows, tile] (rows = :meth:`num_rows`): which positions each
        query row of the reference's layout sees (row ``gi * q_max + j`` is chunk row ``j``
        of query head ``gi`` of a KV head; rows from ``g * q_max`` on are padding and see
        everything, their results are dropped)."""
        key = ("rows", g)
        rows = self.num_rows(g)
        mask = self._masks.get(key)
        if mask is None:
            tile = tile_len(self.block_size)
            n_tiles = self.n_blocks * self.block_size // tile
            nv = self.num_visible.repeat(1, g)  # [B, g * q_max]
            nv = torch.cat([nv, nv.new_full((nv.shape[0], rows - nv.shape[1]), 1 << 30)], 1)
            pos = torch.arange(n_tiles * tile, device=nv.device).view(n_tiles, tile)
            mask = pos[None, :, None, :] < nv[:, None, :, None]  # [B, n_tiles, rows, tile]
            mask = self._masks[key] = mask[:, None]
        return mask


#: Cache dtypes a query dtype may read besides its own: a float32 model over a 16-bit KV cache
#: (``--kv-cache-dtype``, engine/kv_cache.py), whose K/V every implementation widens exactly
#: to float32 before its products.
NARROW_KV_DTYPES: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.float32: (torch.bfloat16, torch.float16)}


def check_tensors(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raises ValueError unless q [T, H, D] and k_cache == v_cache [blocks, block_size, Hkv,
    D] agree in head_dim, H is a multiple of Hkv, k_cache and v_cache share a dtype and that
    dtype is q's or one of :data:`NARROW_KV_DTYPES` of q's."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [T, H, D] and k_cache == v_cache [blocks, block_size, Hkv, D]"
                         f", got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"head_dim {q.shape[2]} vs {k_cache.shape[3]}, or {q.shape[1]} query "
                         f"heads not a multiple of {k_cache.shape[2]} KV heads")
    if k_cache.dtype != v_cache.dtype or (
            k_cache.dtype != q.dtype and k_cache.dtype not in NARROW_KV_DTYPES.get(q.dtype, ())):
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")


def resolve_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor | list[list[int]],
                 query_lens: torch.Tensor | list[int], kv_lens: torch.Tensor | list[int],
                 plan: PagedAttentionPlan | None,
                 tree_masks: list[torch.Tensor | None] | None) -> PagedAttentionPlan:
    """The common preamble of every paged-attention entry point: :func:`check_tensors`, then
    ``plan`` (or one built from the lengths, tables and masks), checked against q's rows and
    the cache's block size.

    Raises:
        ValueError: as :func:`check_tensors` and :func:`plan_paged_attention`; a plan whose
            rows are not q's or built for another block size.
    """
    check_tensors(q, k_cache, v_cache)
    block_size = k_cache.shape[1]
    if plan is None:
        plan = plan_paged_attention(query_lens, kv_lens, block_tables, block_size, q.device,
                                    tree_masks)
    if plan.token_batch.numel() != q.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows, query_lens sum to "
                         f"{plan.token_batch.numel()}")
    if plan.block_size != block_size:
        raise ValueError(f"plan built for block size {plan.block_size}, cache has {block_size}")
    return plan


def check_block_ids(plan: PagedAttentionPlan, num_blocks: int) -> None:
    """Raises ValueError unless every id of ``plan.block_tables`` lies in ``[0, num_blocks)``
    (what code that reads through the ids unchecked needs); checked once per plan and cache
    size, not in every layer."""
    if plan._masks.get("block_ids_checked") == num_blocks:
        return
    tables = plan.block_tables
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(f"block_tables hold ids outside [0, {num_blocks}) (got "
                         f"[{int(tables.min())}, {int(tables.max())}])")
    plan._masks["block_ids_checked"] = num_blocks


def _as_list(x: torch.Tensor | list[int], name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1 or x.dtype not in _INT_DTYPES:
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor, got "
                             f"{x.dtype} {tuple(x.shape)}")
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def plan_paged_attention(
    query_lens: torch.Tensor | list[int],
    kv_lens: torch.Tensor | list[int],
    block_tables: torch.Tensor | list[list[int]],
    block_size: int,
    device: str | torch.device = "cpu",
    tree_masks: list[torch.Tensor | None] | None = None,
) -> PagedAttentionPlan:
    """Build the :class:`PagedAttentionPlan` of a batch (host-side lengths, one sync at most).

    ``tree_masks``: per request None (a chain) or its bool ``[q, q]`` chunk ancestry mask (see
    the module doc); None or all None: no tree in the batch.

    Raises:
        ValueError: lengths of different sizes, an empty batch, a request with no query rows,
            more query rows than KV positions, a block table too short for its KV length, or a
            tree mask of the wrong shape, not lower-triangular, or without its diagonal or
            root column.
    """
    q_lens, n_lens = _as_list(query_lens, "query_lens"), _as_list(kv_lens, "kv_lens")
    if isinstance(block_tables, torch.Tensor):
        if block_tables.dim() != 2 or block_tables.dtype not in _INT_DTYPES:
            raise ValueError(f"block_tables must be a 2-D int tensor, got "
                             f"{block_tables.dtype} {tuple(block_tables.shape)}")
        widths = [block_tables.shape[1]] * block_tables.shape[0]
        tables = block_tables.to(device=device, dtype=torch.long)
    else:
        widths = [len(t) for t in block_tables]
        tables = None
    if not q_lens or not len(q_lens) == len(n_lens) == len(widths):
        raise ValueError(f"need one query length, KV length and block table per request, got "
                         f"{len(q_lens)}, {len(n_lens)}, {len(widths)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for b, (q, n, w) in enumerate(zip(q_lens, n_lens, widths)):
        if q < 1 or n < q:
            raise ValueError(f"request {b}: need 1 <= query_len <= kv_len, got {q}, {n}")
        if w * block_size < n:
            raise ValueError(f"request {b}: {w} blocks of {block_size} cannot hold {n} positions")
    if tables is None:  # only the blocks a tile can reach, padded with a valid id
        width = -(-max(n_lens) // tile_len(block_size)) * tile_len(block_size) // block_size
        tables = torch.tensor([t[:width] + [t[0]] * (width - min(len(t), width))
                               for t in block_tables], dtype=torch.long, device=device)
    masks = _tree_masks(tree_masks, q_lens) if tree_masks is not None else None
    if masks is None or all(m is None for m in masks):
        return _chain_plan(q_lens, n_lens, tables, block_size, device)
    return _tree_plan(q_lens, n_lens, tables, block_size, device, masks)


def _chain_plan(q_lens: list[int], n_lens: list[int], tables: torch.Tensor, block_size: int,
                device: str | torch.device) -> PagedAttentionPlan:
    """The plan of a batch of chains (validated lengths; ``tables`` long [B, >= needed])."""
    tile = tile_len(block_size)
    n_blocks = -(-max(n_lens) // tile) * tile // block_size
    if tables.shape[1] < n_blocks:  # pad to whole tiles (the padding is never visible)
        tables = torch.cat([tables, tables[:, :1].expand(-1, n_blocks - tables.shape[1])], 1)
    tables = tables[:, :n_blocks].contiguous()
    q_max = max(q_lens)
    token_batch = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    token_row = torch.cat([torch.arange(q) for q in q_lens])
    # row j of request b sees p < n - q + j + 1
    num_visible = (torch.tensor(n_lens) - torch.tensor(q_lens) + 1)[:, None] + \
        torch.arange(q_max)[None, :]
    token_visible = num_visible[token_batch, token_row].to(torch.int32)
    return PagedAttentionPlan(token_batch.to(device), token_row.to(device),
                              num_visible.to(device), tables, q_max, n_blocks,
                              token_visible.to(device), block_size)


def _tree_plan(q_lens: list[int], n_lens: list[int], tables: torch.Tensor, block_size: int,
               device: str | torch.device,
               masks: list[torch.Tensor | None]) -> PagedAttentionPlan:
    """A batch with token trees: row ``j`` of a tree sees ``n - q + len(path_j)`` positions,
    the last ``len(path_j)`` of them its path's rows (token_path for the kernel; for the
    reference, the (row, KV tile) pairs whose tile holds path rows out of place, each with the
    source position of every slot of that tile)."""
    plan = _chain_plan(q_lens, n_lens, tables, block_size, device)
    tile = tile_len(block_size)
    num_visible = plan.num_visible.cpu().clone()
    paths: list[list[int]] = []  # per query token, the chunk rows it reads, in order
    pair_req, pair_row, pair_tile, pair_src = [], [], [], []
    for b, (q, n, m) in enumerate(zip(q_lens, n_lens, masks)):
        start = n - q
        for j in range(q):
            path = [c for c in range(j + 1) if m[j, c]] if m is not None else list(range(j + 1))
            paths.append(path)
            num_visible[b, j] = start + len(path)
            if path == list(range(j + 1)):
                continue  # a chain row: its path already lies in place
            for t in range(start // tile, (start + len(path) - 1) // tile + 1):
                src = list(range(t * tile, (t + 1) * tile))
                for d, c in enumerate(path):
                    if t * tile <= start + d < (t + 1) * tile:
                        src[start + d - t * tile] = start + c
                pair_req.append(b)
                pair_row.append(j)
                pair_tile.append(t)
                pair_src.append(src)
    width = max(q_lens)
    token_path = torch.tensor([p + list(range(len(p), width)) for p in paths],
                              dtype=torch.int32)
    token_chunk_start = torch.tensor([n - q for q, n in zip(q_lens, n_lens)])
    token_chunk_start = token_chunk_start.repeat_interleave(torch.tensor(q_lens))
    tb, tr = plan.token_batch.cpu(), plan.token_row.cpu()
    pairs = None
    if pair_req:
        src = torch.tensor(pair_src)
        blocks = tables.cpu()[torch.tensor(pair_req)[:, None], src // block_size]
        slots = (blocks * block_size + src % block_size).view(-1)
        pairs = tuple(torch.tensor(x, dtype=torch.long).to(device)
                      for x in (pair_req, pair_row, pair_tile)) + (slots.to(device),)
    return replace(plan, num_visible=num_visible.to(device),
                   token_visible=num_visible[tb, tr].to(torch.int32).to(device),
                   token_path=token_path.to(device),
                   token_chunk_start=token_chunk_start.to(torch.int32).to(device),
                   path_tiles=pairs)


def _tree_masks(tree_masks: list[torch.Tensor | None], q_lens: list[int],
                ) -> list[torch.Tensor | None]:
    """The validated masks (on the CPU), one per request."""
    if len(tree_masks) != len(q_lens):
        raise ValueError(f"need one tree mask (or None) per request, got {len(tree_masks)} "
                         f"for {len(q_lens)}")
    out: list[torch.Tensor | None] = []
    for b, (m, q) in enumerate(zip(tree_masks, q_lens)):
        if m is None:
            out.append(None)
            continue
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (q, q):
            raise ValueError(f"request {b}: tree mask must be a bool [{q}, {q}] tensor, got "
                             f"{getattr(m, 'dtype', type(m))} {tuple(getattr(m, 'shape', ()))}")
        m = m.cpu()
        if bool(m.triu(1).any()) or not bool(m.diagonal().all()) or not bool(m[:, 0].all()):
            raise ValueError(f"request {b}: a tree mask must be lower-triangular with a true "
                             f"diagonal and root column (row j sees its ancestors and itself)")
        out.append(m)
    return out


__all__ = ["MIN_MATMUL_ROWS", "TILE_TOKENS", "PagedAttentionPlan", "check_tensors",
           "plan_paged_attention", "tile_len"]
