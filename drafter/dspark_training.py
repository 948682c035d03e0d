"""Training and evaluating a DSpark draft (``specmesh train-drafter --method dspark``).

The backbone is a PARD draft (drafter/pard_training.py): the target's first layers, or a
trained PARD checkpoint to start from (``--dspark-backbone``), learning to fill a block of
mask tokens on the COD layout of drafter/pard_block.py (every anchor of a sample in one
forward). On top, the Markov and confidence heads of drafter/dspark_markov.py:

- each labelled row of the layout gets its Markov feature from the token before it *as the
  target wrote it* (teacher forcing): the anchor's own token for the anchor's row (draft 1),
  the target's token at the previous position for mask copy i (draft i + 1); the ``rnn``
  state runs along each anchor's copies in order (:func:`row_structure`). That is exactly
  the walk at serving time given that the earlier drafts were accepted;
- the drafting loss is PARD's cross-entropy, on the corrected logits (base + Markov bias);
- the confidence head learns, with binary cross-entropy weighted by ``confidence_weight``,
  whether the corrected argmax equals the target's token (the draft's survival given that
  its prefix survived); its inputs are detached, so calibration never trades off drafting.

Evaluation (:func:`evaluate`) runs the serving proposer on held-out samples: acceptance per
draft position counted as drafter/pard_training.py's ``acceptance`` counts it, and the
confidence head's calibration (mean predicted vs realised survival of the drafts judged, i.e.
those whose earlier drafts were all right, per position, and the Brier score).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specmesh.drafter.dspark_markov import MarkovHead
from specmesh.drafter.eagle.data import Sample
from specmesh.drafter.head_confidences import split_confidences
from specmesh.drafter.pard_block import (
    IGNORE,
    CodLayout,
    cod_layout,
    collate_layouts,
    keep_schedule,
)
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.train_steps import TrainSteps


def row_structure(layout: CodLayout, num_real: int, label_ids: list[int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a COD layout (``num_real`` real rows, then the mask copies): the previous
    token its Markov feature reads, its depth in its anchor's block (0: a real row, i: mask
    copy i) and the row of the same block one position before (-1 at depth 0), all [L]."""
    ids = layout.input_ids
    L = ids.numel()
    prev = ids.clone()
    depth = torch.zeros(L, dtype=torch.long)
    pred = torch.full((L,), -1, dtype=torch.long)
    if L > num_real:
        # a mask copy of anchor a attends to the real rows 0 .. a
        anchors = layout.allowed[num_real:, :num_real].sum(1) - 1
        pos = layout.position_ids[num_real:]
        depth[num_real:] = pos - anchors
        prev[num_real:] = torch.tensor(label_ids)[pos]
        rows = torch.arange(num_real, L)
        pred[num_real:] = torch.where(depth[num_real:] == 1, anchors, rows - 1)
    return prev, depth, pred


def collate(layouts: list[CodLayout], structures: list[tuple]) -> dict[str, torch.Tensor]:
    """The batch of :func:`drafter.pard_block.collate_layouts` plus the padded row structure
    (``prev`` 0, ``depth`` 0, ``pred`` -1 on padding, which carries no loss); ``pred`` as an
    index into the flattened [B * L] rows."""
    ids, pos, labels, mask4d = collate_layouts(layouts)
    B, L = ids.shape
    prev = torch.zeros(B, L, dtype=torch.long)
    depth = torch.zeros(B, L, dtype=torch.long)
    pred = torch.full((B, L), -1, dtype=torch.long)
    for b, (p, d, r) in enumerate(structures):
        n = p.numel()
        prev[b, :n], depth[b, :n] = p, d
        pred[b, :n] = torch.where(r >= 0, r + b * L, r)
    return {"ids": ids, "pos": pos, "labels": labels, "mask4d": mask4d, "prev": prev,
            "depth": depth, "pred": pred}


def markov_features(head: MarkovHead, hidden: torch.Tensor, prev_emb: torch.Tensor,
                    depth: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """The Markov feature ``z`` of every row, [N, r], from flattened ``hidden`` [N, d],
    ``prev_emb`` [N, d], ``depth`` [N] and ``pred`` [N] (flat index of the row one block
    position before, -1 at depth 0): all rows at once for ``vanilla`` / ``gated``, depth by
    depth for ``rnn`` (each row's state continues its predecessor's)."""
    if head.kind != "rnn":
        return head.step(hidden, prev_emb)[0]
    N = hidden.shape[0]
    z = hidden.new_zeros((N, head.rank))
    inv = torch.full((N,), -1, dtype=torch.long, device=hidden.device)
    states = None
    for d in range(int(depth.max()) + 1 if N else 0):
        rows = (depth == d).nonzero().squeeze(-1)
        if rows.numel() == 0:
            break
        before = None if d == 0 else states[inv[pred[rows]]]
        zd, sd = head.step(hidden[rows], prev_emb[rows], before)
        z = z.index_copy(0, rows, zd)
        inv[rows] = torch.arange(rows.numel(), device=hidden.device)
        states = sd
    return z


def dspark_loss(draft: Any, head: MarkovHead, mask_embedding: torch.Tensor,
                batch: dict[str, torch.Tensor], mask_token_id: int, *,
                confidence_weight: float = 1.0, train_backbone: bool = True
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a collated batch (module docstring) and its parts (``ce``, ``bce``, the
    corrected argmax's ``accuracy`` over the labelled rows)."""
    ids, labels = batch["ids"], batch["labels"]
    with torch.set_grad_enabled(train_backbone and torch.is_grad_enabled()):
        emb = draft.model.embed_tokens(ids)
        emb = torch.where((ids == mask_token_id)[..., None], mask_embedding.to(emb.dtype), emb)
        hidden = draft.model(inputs_embeds=emb, attention_mask=batch["mask4d"],
                             position_ids=batch["pos"], use_cache=False).last_hidden_state
    d = hidden.shape[-1]
    flat_h = hidden.reshape(-1, d).float()
    prev_emb = draft.model.embed_tokens(batch["prev"]).reshape(-1, d).float().detach()
    z = markov_features(head, flat_h, prev_emb, batch["depth"].reshape(-1),
                        batch["pred"].reshape(-1))
    sel = (labels != IGNORE).reshape(-1)
    target = labels.reshape(-1)[sel]
    base = draft.lm_head(hidden.reshape(-1, d)[sel]).float()
    corrected = base + head.bias(z[sel])
    corrected = corrected.masked_fill(
        torch.arange(corrected.shape[-1], device=corrected.device) == mask_token_id,
        float("-inf"))
    ce = F.cross_entropy(corrected, target)
    hit = (corrected.detach().argmax(-1) == target).float()
    conf_logit = head.confidence_logit(flat_h[sel].detach(), z[sel].detach())
    bce = F.binary_cross_entropy_with_logits(conf_logit, hit)
    loss = ce + confidence_weight * bce
    return loss, {"ce": float(ce.detach()), "bce": float(bce.detach()),
                  "accuracy": float(hit.mean()) if hit.numel() else 0.0}


def train(draft: Any, head: MarkovHead, samples: list[Sample], *, mask_token_id: int,
          block: int, epochs: float, batch_size: int, lr: float,
          mask_embedding: torch.Tensor | None = None, train_backbone: bool = True,
          confidence_weight: float = 1.0, seed: int = 0, warmup_steps: int = 20,
          cod_ratio: float = 0.7, cod_floor: float = 0.2, max_seconds: float | None = None,
          autocast_dtype: torch.dtype | None = None, progress: bool = True
          ) -> tuple[torch.Tensor, dict]:
    """AdamW over ``epochs`` of ``samples`` (or until ``max_seconds``) on :func:`dspark_loss`;
    the embedding and LM head frozen, the backbone too unless ``train_backbone``.
    ``mask_embedding``: the mask vector to start from (a PARD backbone's; None: the mask id's
    embedding row). Returns (the trained mask embedding [d], a summary)."""
    samples = [s for s in samples if s.num_output_tokens > 2]
    if not samples:
        raise ValueError("no training sample has more than 2 output tokens")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    keep = keep_schedule(block, cod_ratio, cod_floor)
    embed = draft.model.embed_tokens.weight
    start = embed[mask_token_id] if mask_embedding is None else mask_embedding
    mask_vec = torch.nn.Parameter(start.detach().clone().float())
    frozen = {id(embed), id(draft.lm_head.weight)}
    for p in draft.parameters():
        p.requires_grad_(train_backbone and id(p) not in frozen)
    params = list(head.parameters())
    if train_backbone:
        params += [p for p in draft.parameters() if id(p) not in frozen] + [mask_vec]
    else:
        mask_vec.requires_grad_(False)
    steps = TrainSteps(params, samples, epochs=epochs, batch_size=batch_size, lr=lr,
                       warmup_steps=warmup_steps, seed=seed, max_seconds=max_seconds,
                       desc="train dspark", progress=progress)
    draft.train(train_backbone)
    head.train()
    parts: dict[str, float] = {}
    for group in steps:
        layouts = [cod_layout(s.token_ids, s.label_ids, s.prompt_len - 1, block,
                              mask_token_id, keep, gen) for s in group]
        batch = collate(layouts, [row_structure(x, len(s.token_ids), s.label_ids)
                                  for x, s in zip(layouts, group)])
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            loss, parts = dspark_loss(draft, head, mask_vec, batch, mask_token_id,
                                      confidence_weight=confidence_weight,
                                      train_backbone=train_backbone)
        steps.update(loss, int((batch["labels"] != IGNORE).sum()),
                     acc=f"{parts['accuracy']:.2f}")
    draft.eval()
    head.eval()
    return mask_vec.detach(), {
        **steps.summary(), "last_parts": {k: round(v, 4) for k, v in parts.items()},
        "epochs": epochs, "block": block, "backbone_trained": train_backbone,
        "confidence_weight": confidence_weight, "cod_keep": [round(k, 4) for k in keep],
        "autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype else "none"}


@torch.inference_mode()
def evaluate(proposer: Any, samples: list[Sample], depth: int,
             batch_size: int = 16) -> dict:
    """Acceptance per draft position 1..``depth`` of ``proposer`` (a DSparkProposer) over the
    output positions of ``samples`` but the first, as drafter/pard_training.py's
    ``acceptance`` counts it, and the confidence head's calibration over the judged drafts
    (module docstring): ``{"acceptance_per_position", "calibration": {"judged",
    "mean_predicted", "mean_realised", "brier", "per_position": [[predicted, realised,
    judged], ...]}}``."""
    hits = [0] * depth
    total = 0
    pred_sum, real_sum, judged = [0.0] * depth, [0] * depth, [0] * depth
    brier = 0.0
    samples = [s for s in samples if s.num_output_tokens > 1]
    for lo in range(0, len(samples), batch_size):
        group = samples[lo:lo + batch_size]
        names = [f"eval-{lo + i}" for i in range(len(group))]
        nxt = [s.prompt_len + 1 for s in group]
        while True:
            act = [i for i, s in enumerate(group) if nxt[i] < len(s.token_ids)]
            if not act:
                break
            out = proposer.propose_many([ProposeCall(names[i], group[i].token_ids[:nxt[i]],
                                                     depth) for i in act])
            for i, (drafts, rows) in zip(act, out):
                ids = group[i].token_ids
                conf = split_confidences(rows)[1]
                for k in range(depth):
                    if k >= len(drafts) or nxt[i] + k >= len(ids):
                        break
                    ok = drafts[k] == ids[nxt[i] + k]
                    if k < len(conf):
                        pred_sum[k] += conf[k]
                        real_sum[k] += ok
                        judged[k] += 1
                        brier += (conf[k] - ok) ** 2
                    if not ok:
                        break
                    hits[k] += 1
                total += 1
                nxt[i] += 1
        for name in names:
            proposer.close(name)
    n = max(sum(judged), 1)
    return {"acceptance_per_position": [h / max(total, 1) for h in hits],
            "calibration": {
                "judged": sum(judged), "mean_predicted": round(sum(pred_sum) / n, 4),
                "mean_realised": round(sum(real_sum) / n, 4), "brier": round(brier / n, 4),
                "per_position": [[round(p / max(j, 1), 4), round(r / max(j, 1), 4), j]
                                 for p, r, j in zip(pred_sum, real_sum, judged)]}}


__all__ = ["collate", "dspark_loss", "evaluate", "markov_features", "row_structure", "train"]
