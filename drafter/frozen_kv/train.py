"""Training and evaluation of a frozen-KV MTP assistant (drafter/frozen_kv/assistant.py) by
self-distillation on the target's own generations (drafter/eagle/data.py samples: prompt +
greedy output, labelled with the target's greedy token at every output position).

Per sample the target runs once more over the whole sequence (:func:`target_sequences`), which
gives what serving gives the assistant: the final hidden state at every position and the K/V of
the assistant's target layer (keys after RoPE). Every output position ``s`` (the last committed
token of some commit, ``s >= prompt_len``) is an anchor: ``depth`` steps from it, all at RoPE
position ``s`` over rows ``[0, s)``, step k predicting the greedy token at ``s + k + 1``;
training is teacher-forced on the sequence's tokens, the evaluation drafts chains with the
assistant's own argmax as served. Loss: per step the cross-entropy of the label (within the
draft vocabulary), weighted 0.8^k, plus ``reg_weight`` times a smooth-L1 pull of the step's
output towards the target's own state there (what the next step would read in the target).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmesh.drafter.frozen_kv.assistant import FrozenKVAssistant
from specmesh.engine.dense_kv import DenseBatch, DenseKVCache

#: weight of draft step k's loss: STEP_DECAY ** k
STEP_DECAY = 0.8


@dataclass
class TargetSequence:
    """One sample as the assistant sees it: ``token_ids`` / ``labels`` [T] (labels: the
    target's greedy token at each position), ``hidden`` [T, d] the target's final hidden
    states, ``keys`` / ``values`` [T, Hkv, D] the target layer's K/V, ``prompt_len``."""

    token_ids: torch.Tensor
    labels: torch.Tensor
    hidden: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    prompt_len: int

    @property
    def anchors(self) -> torch.Tensor:
        """Anchor positions ``s``: every output position with a next token to predict."""
        return torch.arange(max(self.prompt_len, 1), self.token_ids.shape[0] - 1)


def target_sequences(lm, samples: list, layer: int, batch_size: int = 8  # noqa: ANN001
                     ) -> list[TargetSequence]:
    """Run the target (``lm``: engine.loader.LoadedModel) over each sample's whole sequence,
    ``batch_size`` samples per forward over a DenseKVCache, keeping its final hidden states
    and layer ``layer``'s K/V (float32)."""
    model, config = lm.model, lm.config
    out = []
    for lo in range(0, len(samples), batch_size):
        group = samples[lo:lo + batch_size]
        longest = max(len(s.token_ids) for s in group)
        cache = DenseKVCache(config, len(group), longest, model.dtype, model.device)
        batch = DenseBatch(list(range(len(group))), [0] * len(group),
                           [len(s.token_ids) for s in group])
        cache.check(batch)
        flat = [t for s in group for t in s.token_ids]
        pos = [p for s in group for p in range(len(s.token_ids))]
        with torch.inference_mode():
            _, hidden = model(torch.tensor(flat, device=model.device),
                              torch.tensor(pos, device=model.device), batch, cache,
                              return_hidden=True, logits_indices=torch.tensor([0]))
        start = 0
        for slot, s in enumerate(group):
            n = len(s.token_ids)
            out.append(TargetSequence(
                token_ids=torch.tensor(s.token_ids), labels=torch.tensor(s.label_ids),
                hidden=hidden[start:start + n].float().clone(),
                keys=cache.k[layer, slot, :, :n].transpose(0, 1).float().clone(),
                values=cache.v[layer, slot, :, :n].transpose(0, 1).float().clone(),
                prompt_len=s.prompt_len))
            start += n
    return out


def sequence_loss(model: FrozenKVAssistant, seq: TargetSequence, depth: int,
                  to_draft: torch.Tensor, reg_weight: float) -> tuple[torch.Tensor, int]:
    """(summed loss, labelled steps) of one sequence (module docstring)."""
    anchors = seq.anchors
    if anchors.numel() == 0:
        return torch.zeros(()), 0
    T = seq.token_ids.shape[0]
    outs = model.unrolled(seq.token_ids, seq.hidden, seq.keys, seq.values, anchors, depth)
    total, count = torch.zeros(()), 0
    for k, g in enumerate(outs):
        where = anchors + k + 1
        valid = where < T
        if not bool(valid.any()):
            break
        labels = to_draft[seq.labels[where[valid]]]
        ce = F.cross_entropy(model.logits(g[valid]).float(), labels, ignore_index=-1,
                             reduction="sum")
        reg = F.smooth_l1_loss(g[valid].float(), seq.hidden[anchors[valid] + k],
                               reduction="sum") / g.shape[-1]
        total = total + STEP_DECAY ** k * (ce + reg_weight * reg)
        count += int((labels >= 0).sum())
    return total, count


def train(model: FrozenKVAssistant, seqs: list[TargetSequence], *, epochs: float,
          batch_size: int, lr: float, depth: int, to_draft: torch.Tensor,
          reg_weight: float = 0.5, seed: int = 0, max_minutes: float | None = None,
          progress=None) -> dict:  # noqa: ANN001
    """AdamW with a cosine schedule over ``epochs`` passes of ``batch_size`` sequences per
    step, stopped early after ``max_minutes``; returns a summary (steps, seconds, last loss).
    ``progress(step, loss)`` is called after every step."""
    rng = random.Random(seed)
    steps_per_epoch = max(1, math.ceil(len(seqs) / batch_size))
    total_steps = max(1, int(round(epochs * steps_per_epoch)))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / total_steps)))
    t0 = time.perf_counter()
    order: list[int] = []
    step, last = 0, float("nan")
    model.train()
    while step < total_steps:
        if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes:
            break
        if len(order) < batch_size:
            more = list(range(len(seqs)))
            rng.shuffle(more)
            order += more
        batch, order = order[:batch_size], order[batch_size:]
        opt.zero_grad()
        loss, n = torch.zeros(()), 0
        for i in batch:
            part, count = sequence_loss(model, seqs[i], depth, to_draft, reg_weight)
            loss, n = loss + part, n + count
        if n:
            (loss / n).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            last = float(loss.detach()) / n
        sched.step()
        step += 1
        if progress:
            progress(step, last)
    model.eval()
    return {"steps": step, "planned_steps": total_steps, "seconds": time.perf_counter() - t0,
            "final_loss": last, "stopped_early": step < total_steps}


@torch.no_grad()
def acceptance(model: FrozenKVAssistant, seqs: list[TargetSequence], depth: int) -> list[float]:
    """Per draft position k, the fraction of anchors whose chain (drafted with the
    assistant's own argmax, as served) matches the target's greedy tokens at positions
    ``s + 1 .. s + k + 1``; the sum is the mean accepted drafts per chain of ``depth``."""
    hits, seen = [0] * depth, [0] * depth
    for seq in seqs:
        anchors = seq.anchors
        if anchors.numel() == 0:
            continue
        T = seq.token_ids.shape[0]
        outs = model.unrolled(seq.token_ids, seq.hidden, seq.keys, seq.values, anchors, depth,
                              own_drafts=True)
        alive = torch.ones_like(anchors, dtype=torch.bool)
        for k, g in enumerate(outs):
            where = anchors + k + 1
            valid = where < T
            draft = model.target_ids(model.logits(g).argmax(-1))
            alive = alive & (draft == seq.labels[where.clamp(max=T - 1)])
            hits[k] += int((alive & valid).sum())
            seen[k] += int(valid.sum())
    return [h / s if s else 0.0 for h, s in zip(hits, seen)]
