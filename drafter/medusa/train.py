"""Training and held-out evaluation of Medusa heads (Medusa-1, arXiv 2401.10774: the target
frozen) on self-distilled samples (drafter/eagle/data.py: the target's greedy outputs with
its final hidden states, computed once).

Row ``r`` of a sample is the target's state at position ``s = prompt_len - 1 + r``; head i's
label is the target's token at ``s + 2 + i`` (as a draft-vocabulary index; IGNORE past the
sample's end or outside the draft vocabulary). The loss is Medusa's: the heads' cross-entropies
summed with weights ``head_decay ** i``. The evaluation ranks each label among its head's
top-k candidates: per-head accuracy by rank (what :func:`~drafter.medusa.tree.choose_tree`
builds the tree from), the top-1 chain's acceptance per position and the tree's.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specmesh.drafter.eagle.data import Sample
from specmesh.drafter.medusa.heads import MedusaHeads
from specmesh.drafter.medusa.tree import tree_acceptance

IGNORE = -100


def head_rows(samples: list[Sample], to_draft: torch.Tensor,
              num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training rows of ``samples``: states [N, d] (float32) and labels [N, num_heads] (draft
    vocabulary index, IGNORE where none); ``to_draft`` [vocab] maps a target id to its draft
    index (-1 outside). A row whose head-0 label is past the sample's end is left out."""
    xs, ys = [], []
    offsets = torch.arange(num_heads)
    for s in samples:
        labels = torch.tensor(s.label_ids, dtype=torch.long)
        n_rows = s.num_output_tokens - 1  # the last state's head-0 token is past the end
        if n_rows <= 0:
            continue
        idx = s.prompt_len + 1 + torch.arange(n_rows)[:, None] + offsets[None, :]
        valid = idx < len(s.token_ids)
        lab = to_draft[labels[idx.clamp(max=len(s.token_ids) - 1)]]
        ys.append(torch.where(valid & (lab >= 0), lab, IGNORE))
        xs.append(s.features[:n_rows].float())
    if not xs:
        raise ValueError("no sample has two output tokens: nothing to train the heads on")
    return torch.cat(xs), torch.cat(ys)


def train_heads(heads: MedusaHeads, states: torch.Tensor, labels: torch.Tensor, *,
                epochs: float, batch_rows: int, lr: float, seed: int = 0,
                head_decay: float = 0.8, warmup_steps: int = 20,
                autocast_dtype: torch.dtype | None = None, progress: bool = True) -> dict:
    """AdamW (linear warm-up, cosine decay) over ``epochs`` of the rows ``states`` [N, d] /
    ``labels`` [N, K] in shuffled batches of ``batch_rows``; the target's LM head stays
    frozen. ``autocast_dtype``: the products in that dtype under ``torch.autocast`` (weights
    and optimizer in float32). Returns a summary: steps, seconds, rows/s, last loss and each
    head's last loss."""
    torch.manual_seed(seed)
    n = states.shape[0]
    steps_per_epoch = max(1, math.ceil(n / batch_rows))
    total = max(1, int(round(epochs * steps_per_epoch)))
    opt = torch.optim.AdamW([heads.weight, heads.bias], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.95))
    weights = torch.tensor([head_decay ** i for i in range(heads.config.num_heads)])

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total - warmup_steps)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    heads.train()
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="train medusa", unit="step", disable=not progress)
    order = torch.randperm(n)
    per_head = torch.zeros(heads.config.num_heads)
    loss = torch.tensor(0.0)
    for step in range(total):
        lo = (step % steps_per_epoch) * batch_rows
        if lo == 0 and step:
            order = torch.randperm(n)
        idx = order[lo:lo + batch_rows]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            logits = heads(states[idx])  # [K, B, V]
        y = labels[idx].T  # [K, B]
        ce = torch.stack([F.cross_entropy(logits[i].float(), y[i], ignore_index=IGNORE)
                          if bool((y[i] != IGNORE).any()) else logits[i].sum() * 0.0
                          for i in range(y.shape[0])])
        loss = (weights * ce).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        per_head = ce.detach()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    bar.close()
    heads.eval()
    secs = time.perf_counter() - t0
    return {"steps": total, "train_seconds": round(secs, 1),
            "rows_per_second": round(total * batch_rows / max(secs, 1e-9), 1),
            "last_loss": round(float(loss.detach()), 4),
            "last_loss_per_head": [round(float(x), 4) for x in per_head]}


def label_ranks(heads: MedusaHeads, states: torch.Tensor, labels: torch.Tensor, k: int,
                batch_rows: int = 1024) -> torch.Tensor:
    """int64 [N, K]: the rank of each label among its head's top-``k`` draft-vocabulary
    candidates, -1 where it is not among them or there is no label."""
    out = []
    with torch.inference_mode():
        for lo in range(0, states.shape[0], batch_rows):
            top = heads(states[lo:lo + batch_rows]).topk(k, dim=-1).indices  # [K, B, k]
            y = labels[lo:lo + batch_rows].T  # [K, B]
            hit = top == y[..., None]
            rank = torch.where(hit.any(-1), hit.int().argmax(-1), -1)
            out.append(torch.where(y == IGNORE, -1, rank).T)
    return torch.cat(out)


def rank_accuracy(ranks: torch.Tensor, k: int) -> list[list[float]]:
    """``acc[i][j]``: the share of all rows (every head measured on the same steps) whose
    head-i label is its rank-j candidate; a missing label counts as a miss."""
    n = max(ranks.shape[0], 1)
    return [[round(float((ranks[:, i] == j).sum()) / n, 4) for j in range(k)]
            for i in range(ranks.shape[1])]


def chain_acceptance(ranks: torch.Tensor) -> list[float]:
    """Acceptance per position of the heads' top-1 chain: the share of rows whose first d
    heads all have their label at rank 0."""
    ok = torch.cumprod((ranks == 0).int(), dim=1)
    return [round(float(x), 4) for x in ok.float().mean(0)]


def evaluate(heads: MedusaHeads, states: torch.Tensor, labels: torch.Tensor,
             tree: tuple, k: int) -> dict:
    """Held-out numbers of ``heads``: per-head accuracy by rank (top ``k``), each head's top-1
    and top-k accuracy, the top-1 chain's and the static ``tree``'s acceptance per depth, and
    the mean accepted drafts per step of each (their sums)."""
    ranks = label_ranks(heads, states, labels, k)
    acc = rank_accuracy(ranks, k)
    chain = chain_acceptance(ranks)
    tree_acc = [round(x, 4) for x in tree_acceptance(ranks.tolist(), tree)]
    return {"rows": int(ranks.shape[0]), "accuracy_by_rank": acc,
            "top1_per_head": [a[0] for a in acc],
            f"top{k}_per_head": [round(sum(a), 4) for a in acc],
            "chain_acceptance_per_position": chain,
            "chain_mean_accepted": round(sum(chain), 4),
            "tree_nodes": len(tree), "tree_acceptance_per_depth": tree_acc,
            "tree_mean_accepted": round(sum(tree_acc), 4)}


def report(label: str, ev: dict) -> str:
    """One printable paragraph of :func:`evaluate`'s numbers."""
    def fmt(xs: list[float]) -> str:
        return " ".join(f"{x:.3f}" for x in xs)
    topk = next(key for key in ev if key.startswith("top") and key != "top1_per_head")
    return (f"{label} ({ev['rows']} steps): top-1 per head {fmt(ev['top1_per_head'])}; "
            f"{topk.split('_')[0]} per head {fmt(ev[topk])}\n"
            f"  chain acceptance per position {fmt(ev['chain_acceptance_per_position'])} "
            f"(mean accepted {ev['chain_mean_accepted']:.2f}); tree of {ev['tree_nodes']} "
            f"nodes {fmt(ev['tree_acceptance_per_depth'])} "
            f"(mean accepted {ev['tree_mean_accepted']:.2f})")
