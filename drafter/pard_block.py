"""The mask block of PARD (parallel draft model; An et al., "PARD: Accelerating LLM Inference
with Low-Cost PARallel Draft Model Adaptation", arXiv 2504.18583; AMD-AGI/PARD
``pard_infer.py``): at serving time, the input of the draft model's one forward per step; at
training time, the conditional-drop-token (COD) layout that trains every block position of
every anchor in one forward.

Serving (:func:`block_input`): the draft model's KV holds a prefix of the context; the forward
feeds the rest of the context (the committed tail, usually the tokens accepted since the last
step plus the bonus token) followed by ``num_drafts - 1`` copies of the mask token id, at
consecutive positions. The logits of the last context token give draft 1, those of mask j
(j = 1 .. num_drafts - 1) draft j + 1: ``num_drafts`` drafts for one forward (cost 1 + c per
step instead of 1 + num_drafts * c for a chain). Afterwards only the context's K/V count: the
mask rows' KV slots lie past the cached length and are overwritten by the next forward.

Training (:func:`cod_layout`): one sequence holds the real tokens (copy 0, next-token labels)
and, for each anchor a (the last real token of a context), mask copies i = 1 .. K-1 at
position a + i labelled with the token at a + 1 + i, each attending to the real tokens up to a
and to the anchor's mask copies 1 .. i. COD keeps copy i of an anchor with probability
``keep[i - 1]`` (non-increasing, so the kept copies of an anchor are always 1 .. m: the block
prefix a kept mask attends to is always there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: label of a row without loss (torch's cross-entropy ignore_index)
IGNORE = -100


@dataclass(frozen=True)
class BlockInput:
    """One request's draft forward: ``token_ids`` fed at positions ``start_pos ..``; the last
    ``num_drafts`` rows' logits are the drafts (row ``len(token_ids) - num_drafts + j`` gives
    draft j + 1); ``num_context`` of the tokens are context (the rest are mask tokens)."""

    token_ids: list[int]
    start_pos: int
    num_drafts: int
    num_context: int


def block_input(context_token_ids: list[int], num_cached: int, num_drafts: int,
                mask_token_id: int) -> BlockInput:
    """The draft forward for ``num_drafts`` drafts continuing ``context_token_ids`` when the
    draft model's KV holds the first ``num_cached`` context tokens: the uncached tail
    (at least the last context token, whose logits give draft 1) then ``num_drafts - 1`` mask
    tokens.

    Raises:
        ValueError: an empty context, ``num_drafts < 1``, or ``num_cached`` outside
            ``[0, len(context)]``.
    """
    n = len(context_token_ids)
    if n == 0 or num_drafts < 1 or not 0 <= num_cached <= n:
        raise ValueError(f"block_input needs a context, num_drafts >= 1 and 0 <= num_cached <= "
                         f"{n}; got {n} tokens, num_drafts={num_drafts}, "
                         f"num_cached={num_cached}")
    start = min(num_cached, n - 1)
    tail = list(context_token_ids[start:])
    return BlockInput(tail + [mask_token_id] * (num_drafts - 1), start, num_drafts, len(tail))


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def keep_schedule(block: int, ratio: float = 0.7, floor: float = 0.2) -> list[float]:
    """COD keep probability of mask copies 1 .. ``block - 1``: ``max(ratio ** (i - 1),
    floor)`` (copy 1 always kept; PARD's example config uses r = 0.7, floor 0.2).

    Raises:
        ValueError: ``block < 1`` or ratios outside (0, 1].
    """
    if block < 1 or not 0 < ratio <= 1 or not 0 < floor <= 1:
        raise ValueError(f"need block >= 1 and ratio, floor in (0, 1]; got {block}, {ratio}, "
                         f"{floor}")
    return [max(ratio ** (i - 1), floor) for i in range(1, block)]


@dataclass
class CodLayout:
    """One training sequence: ``input_ids``, ``position_ids``, ``labels`` [L] (IGNORE: no
    loss) and ``allowed`` [L, L] bool (row q may attend to column k)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    allowed: torch.Tensor


def cod_layout(token_ids: list[int], label_ids: list[int], first_anchor: int, block: int,
               mask_token_id: int, keep: list[float],
               generator: torch.Generator | None = None) -> CodLayout:
    """The COD training sequence of one sample (module docstring).

    Args:
        token_ids: the sample's real tokens x_0 .. x_{n-1} (prompt + the target's output).
        label_ids: the token to predict after each prefix (``label_ids[p]`` is the target's
            greedy token at position p; for a greedy sample it equals ``token_ids[p]``).
        first_anchor: the first anchor a (a real row whose next-token label, and whose mask
            copies' labels, carry loss); rows before it carry none (the prompt).
        block: K, drafts per forward; copies 1 .. K-1 are mask copies.
        mask_token_id: the mask token.
        keep: keep probability of copies 1 .. K-1 (:func:`keep_schedule`), non-increasing.
        generator: the draws of COD (one uniform per anchor).

    Raises:
        ValueError: ``len(keep) != block - 1``, an increasing ``keep``, or lengths that differ.
    """
    n = len(token_ids)
    if len(keep) != block - 1 or any(b > a for a, b in zip(keep, keep[1:])):
        raise ValueError(f"keep needs {block - 1} non-increasing probabilities, got {keep}")
    if len(label_ids) != n:
        raise ValueError(f"{len(label_ids)} labels for {n} tokens")
    first_anchor = max(first_anchor, 0)
    ids, pos, labels = list(token_ids), list(range(n)), [IGNORE] * n
    for p in range(first_anchor, n - 1):
        labels[p] = label_ids[p + 1]
    # mask rows: (anchor, copy)
    anchors = list(range(first_anchor, n - 2))
    u = torch.rand(len(anchors), generator=generator).tolist() if anchors else []
    rows: list[tuple[int, int]] = []
    for a, draw in zip(anchors, u):
        for i in range(1, block):
            if a + 1 + i > n - 1 or draw >= keep[i - 1]:
                break
            rows.append((a, i))
            ids.append(mask_token_id)
            pos.append(a + i)
            labels.append(label_ids[a + 1 + i])
    L = len(ids)
    allowed = torch.zeros(L, L, dtype=torch.bool)
    allowed[:n, :n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    first_row: dict[int, int] = {}
    for r, (a, i) in enumerate(rows):
        q = n + r
        first_row.setdefault(a, q)
        allowed[q, : a + 1] = True
        allowed[q, first_row[a]: q + 1] = True  # the anchor's copies 1 .. i (kept in order)
    return CodLayout(torch.tensor(ids), torch.tensor(pos), torch.tensor(labels), allowed)


def collate_layouts(layouts: list[CodLayout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:
    """Right-padded batch: input_ids, position_ids, labels [B, L] and the 4-D bool attention
    mask [B, 1, L, L] (padding rows attend to themselves only and carry no loss)."""
    L = max(x.input_ids.numel() for x in layouts)
    B = len(layouts)
    ids = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(B, L, dtype=torch.long)
    labels = torch.full((B, L), IGNORE, dtype=torch.long)
    mask = torch.eye(L, dtype=torch.bool).repeat(B, 1, 1)
    for b, x in enumerate(layouts):
        n = x.input_ids.numel()
        ids[b, :n], pos[b, :n], labels[b, :n] = x.input_ids, x.position_ids, x.labels
        mask[b, :n, :n] = x.allowed
    return ids, pos, labels, mask[:, None]
