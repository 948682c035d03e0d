"""Training and evaluation of an EAGLE head on self-distilled samples (drafter/eagle/data.py).

Entry ``s`` of a sample (positions ``prompt_len - 1 .. len - 3``) reads the target's feature
``f_s`` and the token at ``s + 1``; its label is the target's greedy choice at ``s + 2`` (the
token there, or for a sampled continuation ``Sample.label_ids``) as a draft-vocabulary index. The loss sums, over ``depth`` unrolled passes (EAGLE-3's
training-time test, arXiv 2503.01840), the cross-entropy of pass k at the entries where a
k-token chain exists, weighted ``pass_decay ** (k - 1)``, plus EAGLE-1's smooth-L1 regression
of pass 1 onto ``f_{s+1}`` (arXiv 2401.15077). Acceptance at draft position k is the share of
chains whose first k drafts all equal the target's tokens.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specmesh.drafter.eagle.data import Sample, shuffled
from specmesh.drafter.eagle.head import EagleHead

IGNORE = -100


def draft_vocabulary(samples: list[Sample], size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The ``size`` most frequent output tokens of ``samples`` (ties by id), plus ``always``
    (e.g. EOS ids), as LongTensor [size] sorted by id."""
    counts = Counter(t for s in samples for t in s.label_ids[s.prompt_len:])
    chosen = [t for t in always][:size]
    for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    t = 0
    while len(chosen) < size:  # fewer distinct tokens than rows: fill with unused ids
        if t not in chosen:
            chosen.append(t)
        t += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)


@dataclass
class Window:
    """Entries of one sample: ``features`` [S+1, d] (the extra row is the regression target
    of the last entry), ``next_tokens`` [S], ``labels`` [S] (draft-vocab index or IGNORE),
    ``positions`` [S]."""

    features: torch.Tensor
    next_tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor


def windows(samples: list[Sample], to_draft: torch.Tensor, max_len: int = 256) -> list[Window]:
    """Cut samples into windows of at most ``max_len`` entries. ``to_draft`` [vocab] maps a
    target id to its draft-vocabulary index (-1: outside it)."""
    out = []
    for s in samples:
        toks = torch.tensor(s.token_ids, dtype=torch.long)
        targets = torch.tensor(s.label_ids, dtype=torch.long)  # == toks for a greedy sample
        p, n = s.prompt_len, len(s.token_ids)
        num_entries = n - p - 1  # entries s = p-1 .. n-3
        for lo in range(0, num_entries, max_len):
            hi = min(lo + max_len, num_entries)
            pos = torch.arange(p - 1 + lo, p - 1 + hi)
            lab = to_draft[targets[pos + 2]]
            out.append(Window(features=s.features[lo:hi + 1], next_tokens=toks[pos + 1],
                              labels=torch.where(lab < 0, IGNORE, lab), positions=pos))
    return out


def collate(batch: list[Window], dtype: torch.dtype):  # noqa: ANN201
    """Pad windows to one [B, S] batch; padded entries get label IGNORE."""
    S = max(len(w.labels) for w in batch)
    d = batch[0].features.shape[-1]
    B = len(batch)
    feats = torch.zeros(B, S + 1, d, dtype=dtype)
    toks = torch.zeros(B, S, dtype=torch.long)
    labels = torch.full((B, S), IGNORE, dtype=torch.long)
    pos = torch.zeros(B, S, dtype=torch.long)
    valid_next = torch.zeros(B, S, dtype=torch.bool)
    for i, w in enumerate(batch):
        n = len(w.labels)
        feats[i, : w.features.shape[0]] = w.features.to(dtype)
        toks[i, :n], labels[i, :n], pos[i, :n] = w.next_tokens, w.labels, w.positions
        pos[i, n:] = w.positions[-1] + 1 + torch.arange(S - n)
        valid_next[i, : min(n, w.features.shape[0] - 1)] = True
    return feats, toks, labels, pos, valid_next


def chain_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Labels of pass k: rows with no k-token chain (s < k - 1) ignored."""
    out = labels.clone()
    out[:, : k - 1] = IGNORE
    return out


def loss_fn(head: EagleHead, feats, toks, labels, pos, valid_next, depth: int,  # noqa: ANN001
            pass_decay: float = 0.8, reg_weight: float = 0.5,
            soft_weight: float = 0.0):  # noqa: ANN201
    """Total loss and per-pass cross-entropies of one batch (see the module docstring).
    ``soft_weight`` mixes in the cross-entropy against the target's whole distribution over
    the draft vocabulary, ``softmax(lm_head f_{s+1})`` (distillation; EAGLE trains on the
    target's probabilities too): more signal per token than the argmax alone."""
    passes = head.forward_passes(feats[:, :-1], toks, pos, depth=depth)
    total = 0.0
    ces = []
    target_p = None
    if soft_weight:
        with torch.no_grad():
            target_p = torch.softmax(head.logits(feats[:, 1:]).float(), dim=-1)
    for k, g in enumerate(passes, 1):
        lab = chain_labels(labels, k)
        logits = head.logits(g).float()
        ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=IGNORE)
        ces.append(float(ce.detach()))
        term = ce
        if target_p is not None:
            rows = valid_next.clone()
            rows[:, : k - 1] = False
            soft = -(target_p * F.log_softmax(logits, dim=-1)).sum(-1)
            soft = (soft * rows).sum() / rows.sum().clamp(min=1)
            term = (1 - soft_weight) * ce + soft_weight * soft
        total = total + pass_decay ** (k - 1) * term
    if reg_weight:
        m = valid_next[..., None]
        reg = F.smooth_l1_loss(passes[0] * m, feats[:, 1:] * m, reduction="sum")
        total = total + reg_weight * reg / (m.sum() * feats.shape[-1]).clamp(min=1)
    return total, ces


@torch.no_grad()
def acceptance(head: EagleHead, data: list[Window], depth: int,
               batch_size: int = 16) -> list[float]:
    """Acceptance per draft position 1..depth over every chain start in ``data``: the share of
    chains whose first k drafts all equal the target's greedy tokens (a label outside the
    draft vocabulary counts as a miss); a multi-layer head that stops at its last module has
    no position past it."""
    c = head.config
    if c.after_last_step == "stop":
        depth = min(depth, c.num_steps)
    hits = torch.zeros(depth)
    total = 0
    dtype = head.fc.weight.dtype
    for lo in range(0, len(data), batch_size):
        feats, toks, labels, pos, _ = collate(data[lo:lo + batch_size], dtype)
        passes = head.forward_passes(feats[:, :-1], toks, pos, depth=depth)
        pred = torch.stack([head.logits(g).argmax(-1) for g in passes])  # [depth, B, S]
        S = labels.shape[1]
        for i0 in range(S):  # chain starting at entry i0: draft k read at i0 + k - 1
            ok = torch.ones(labels.shape[0], dtype=torch.bool)
            present = labels[:, i0] != IGNORE if i0 < S else None
            ok &= present
            count = int(present.sum())
            if not count:
                continue
            total += count
            for k in range(depth):
                j = i0 + k
                if j >= S:
                    ok = torch.zeros_like(ok)
                else:
                    ok = ok & (pred[k, :, j] == labels[:, j]) & (labels[:, j] != IGNORE)
                hits[k] += int(ok.sum())
    return (hits / max(total, 1)).tolist()


def acceptance_report(acc: list[float]) -> str:
    """One line: acceptance per position and the mean accepted length of a chain."""
    per = " ".join(f"{a:.3f}" for a in acc)
    return f"acceptance per position: {per}  (mean accepted drafts per chain {sum(acc):.2f})"


def train(head: EagleHead, train_windows: list[Window], *, epochs: float, batch_size: int,
          lr: float, depth: int, seed: int = 0, warmup_steps: int = 20,
          pass_decay: float = 0.8, reg_weight: float = 0.5, soft_weight: float = 0.0,
          autocast_dtype: torch.dtype | None = None,
          log=None,  # noqa: ANN001
          progress: bool = True, max_seconds: float | None = None) -> dict:
    """AdamW with linear warm-up and cosine decay over ``epochs`` (may be fractional) of
    ``train_windows``; returns a summary (steps, seconds, entries/s, last loss).

    ``autocast_dtype`` (e.g. ``torch.bfloat16``): mixed precision, the forward and backward
    products run in that dtype under ``torch.autocast`` while the weights, the optimizer state
    and the loss stay in the head's dtype (faster than float32 on a CPU with bf16 products;
    docs/benchmarks.md, 'Training'). ``max_seconds``: stop after that much training (a bounded
    run on a shared host; the summary says how many steps it made). Only parameters that
    require grad are trained (a multi-layer head's frozen module 0)."""
    if head.config.feature_layers and (reg_weight or soft_weight):
        raise ValueError("a fused-feature head (feature_layers) has no d-wide true feature to "
                         "regress onto or to take target probabilities from: reg_weight and "
                         "soft_weight must be 0 (EAGLE-3 trains on the token loss alone)")
    torch.manual_seed(seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = max(1, math.ceil(len(train_windows) / batch_size))
    total_steps = max(1, int(round(epochs * steps_per_epoch)))

    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    dtype = head.fc.weight.dtype
    head.train()
    t0 = time.perf_counter()
    entries = 0
    bar = tqdm(total=total_steps, desc="train", unit="step", disable=not progress)
    step = 0
    loss_val = float("nan")
    epoch = 0
    while step < total_steps:
        order = shuffled(train_windows, seed + epoch)
        epoch += 1
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        for lo in range(0, len(order), batch_size):
            if step >= total_steps or (max_seconds is not None
                                       and time.perf_counter() - t0 > max_seconds):
                break
            feats, toks, labels, pos, valid = collate(order[lo:lo + batch_size], dtype)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                                enabled=autocast_dtype is not None):
                loss, ces = loss_fn(head, feats, toks, labels, pos, valid, depth,
                                    pass_decay=pass_decay, reg_weight=reg_weight,
                                    soft_weight=soft_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            n = int((labels != IGNORE).sum())
            entries += n
            step += 1
            loss_val = float(loss.detach())
            rate = entries / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss_val:.3f}", ce1=f"{ces[0]:.3f}", tok_s=f"{rate:.0f}")
            bar.update(1)
            if log and step % 50 == 0:
                log(f"step {step}/{total_steps} loss {loss_val:.4f} ce {ces} {rate:.0f} tok/s")
    bar.close()
    head.eval()
    secs = time.perf_counter() - t0
    return {"steps": step, "planned_steps": total_steps, "seconds": round(secs, 1),
            "entries_per_s": round(entries / secs, 1),
            "last_loss": round(loss_val, 4), "epochs": epochs,
            "autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype else None}
