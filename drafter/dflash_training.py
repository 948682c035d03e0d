"""Training and evaluating a DFlash draft (``specmesh train-drafter --method dflash``).

Data: the target's own greedy outputs with the hidden states it computed on the way
(drafter/eagle/data.py: ``features`` are the rows at positions ``prompt_len - 1 ..``, the rows
a served request's context holds: the prefill's last prompt row, then one per commit; with
``--feature-layers`` the outputs of those target layers side by side). Labels are the
target's greedy tokens.

Objective (DFlash's block cross-entropy; DeepSpec ``config/dflash``: random anchors, loss
weight decaying exponentially over the block position, there with gamma 4): for an anchor position
``a`` of a sample, the block is ``[x_a, .., x_{a+r}, MASK x k]`` at positions ``a ..`` with
the context rows at positions ``< a``; mask row j (at ``q = a + r + j``) is labelled with the
target's greedy token at ``q``, weight ``exp(-(j - 1) / gamma)`` (``--gamma``, default
:data:`DEFAULT_GAMMA`: a small gamma spends a small draft's capacity on the first positions,
the only ones it gets right). ``r`` (real tokens past the anchor, what a served block carries
when the drafter runs ahead of the verifier) is 0 for half the forwards and uniform in
``1 .. max_run_ahead`` for the others (``--max-run-ahead``, recorded in the config; 0: never,
and the served proposer then drafts only from a committed context); every block has ``k``
mask rows, as served. Up to ``anchors`` anchors of a sample share one forward
(:meth:`DFlashDraft.training_logits`).

Acceptance at draft position k (:func:`acceptance`) is measured with the serving proposer on
the held-out samples: at every output position but the first, one block forward from the true
prefix with the true context rows, and position k counts a hit when drafts 1..k all equal the
target's next k tokens (the numbers of the other methods count the same way).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specmesh.drafter.dflash_model import MASK, DFlashDraft
from specmesh.drafter.eagle.data import Sample
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.train_steps import TrainSteps

#: decay of the loss weight over the block position. DFlash / DeepSpec use 4 for drafts of
#: several layers; a one-layer draft served on a CPU gains from position 1 alone, and 0.5 (with
#: no run-ahead blocks) doubled its held-out acceptance there (docs/drafters.md, DFlash)
DEFAULT_GAMMA = 0.5
#: label of a row without loss
IGNORE = -100


def block_layout(sample: Sample, block: int, run_ahead: int, max_anchors: int,
                 generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The blocks of up to ``max_anchors`` random anchors of ``sample`` with ``run_ahead``
    real tokens past each anchor (module docstring): ``(block_ids [A, B], block_starts [A],
    labels [A, B])``, ``B = 1 + run_ahead + block``, labels IGNORE on the real rows and past
    the sample's end; None when the sample has no anchor for it.

    Raises:
        ValueError: ``block < 1`` or ``run_ahead < 0``.
    """
    if block < 1 or run_ahead < 0:
        raise ValueError(f"need block >= 1 and run_ahead >= 0, got {block}, {run_ahead}")
    ids, labels_all, p = sample.token_ids, sample.label_ids, sample.prompt_len
    n = len(ids)
    anchors = list(range(p, n - 1 - run_ahead))  # a context row (p - 1) and one label
    if not anchors:
        return None
    if len(anchors) > max_anchors:
        pick = torch.randperm(len(anchors), generator=generator)[:max_anchors].sort().values
        anchors = [anchors[i] for i in pick.tolist()]
    B = 1 + run_ahead + block
    block_ids = torch.full((len(anchors), B), MASK, dtype=torch.long)
    labels = torch.full((len(anchors), B), IGNORE, dtype=torch.long)
    for i, a in enumerate(anchors):
        block_ids[i, :run_ahead + 1] = torch.tensor(ids[a:a + run_ahead + 1])
        for j in range(run_ahead + 1, B):
            if a + j < n:
                labels[i, j] = labels_all[a + j]
    return block_ids, torch.tensor(anchors, dtype=torch.long), labels


def position_weights(block: int, run_ahead: int, gamma: float = DEFAULT_GAMMA) -> torch.Tensor:
    """Loss weight of each row of a block [1 + run_ahead + block]: 0 on the real rows,
    ``exp(-(j - 1) / gamma)`` on mask row j = 1 .. block."""
    w = torch.zeros(1 + run_ahead + block)
    w[1 + run_ahead:] = torch.exp(-torch.arange(block, dtype=torch.float) / gamma)
    return w


def sample_loss(draft: DFlashDraft, sample: Sample, block: int, run_ahead: int,
                max_anchors: int, generator: torch.Generator | None = None,
                gamma: float = DEFAULT_GAMMA) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(sum of weighted cross-entropies, sum of weights, labelled rows)`` of one sample's
    blocks (:func:`block_layout`); None when it has none."""
    layout = block_layout(sample, block, run_ahead, max_anchors, generator)
    if layout is None:
        return None
    block_ids, starts, labels = layout
    labels = draft.draft_columns(labels, IGNORE)  # ids outside a draft vocabulary: no loss
    sel = labels != IGNORE
    if not bool(sel.any()):
        return None
    rows = sample.features.float()
    logits = draft.training_logits(rows, sample.prompt_len - 1, block_ids, starts, sel)
    w = position_weights(block, run_ahead, gamma).expand_as(labels)[sel]
    ce = F.cross_entropy(logits.float(), labels[sel], reduction="none")
    return (ce * w).sum(), w.sum(), int(sel.sum())


def init_for_training(draft: DFlashDraft, target_layers: list) -> None:  # noqa: ANN001
    """Start ``draft`` from the target: layer i from ``target_layers[i]``, the fusion as the
    mean of the feature layers' states (identity blocks / n), the mask vector as the mean
    embedding row."""
    c = draft.config
    n_feat = max(1, len(c.feature_layers))
    with torch.no_grad():
        draft.init_from_target(target_layers)
        eye = torch.eye(c.hidden_size) / n_feat
        draft.fc.weight.copy_(torch.cat([eye] * n_feat, dim=1))
        draft.mask_embedding.copy_(draft.embed.float().mean(0))


def train(draft: DFlashDraft, samples: list[Sample], *, epochs: float, batch_size: int,
          lr: float, seed: int = 0, warmup_steps: int = 20, max_anchors: int = 64,
          gamma: float = DEFAULT_GAMMA, max_seconds: float | None = None,
          autocast_dtype: torch.dtype | None = None, progress: bool = True) -> dict:
    """AdamW over ``epochs`` of ``samples`` (or until ``max_seconds``) on the block objective
    (module docstring) with blocks up to the draft config's ``run_ahead_limit`` tokens ahead;
    the target's embedding and LM head are buffers (frozen). Returns a summary.

    Raises:
        ValueError: no sample with two output tokens; ``gamma <= 0``.
    """
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    block = draft.config.block
    run_max = draft.config.run_ahead_limit
    samples = [s for s in samples if s.num_output_tokens > 1]
    if not samples:
        raise ValueError("no training sample has more than 1 output token")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in draft.parameters()]
    for p in params:
        p.requires_grad_(True)
    steps = TrainSteps(params, samples, epochs=epochs, batch_size=batch_size, lr=lr,
                       warmup_steps=warmup_steps, seed=seed, max_seconds=max_seconds,
                       desc="train dflash", progress=progress)
    draft.train()
    for group in steps:
        r = 0 if run_max == 0 or torch.rand(1, generator=gen).item() < 0.5 else \
            int(torch.randint(1, run_max + 1, (1,), generator=gen))
        total = weight = None
        rows = 0
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            for s in group:
                part = sample_loss(draft, s, block, r, max_anchors, gen, gamma)
                if part is None:
                    continue
                total = part[0] if total is None else total + part[0]
                weight = part[1] if weight is None else weight + part[1]
                rows += part[2]
        if total is not None:  # (a batch with no anchor takes no step)
            steps.update(total / weight, rows)
    draft.eval()
    return {**steps.summary(),
            "epochs": epochs, "block": block, "max_run_ahead": run_max,
            "max_anchors": max_anchors, "gamma": gamma,
            "autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype else "none"}


@torch.inference_mode()
def acceptance(proposer: Any, samples: list[Sample], depth: int,
               batch_size: int = 16) -> list[float]:
    """Acceptance per draft position 1..``depth`` of ``proposer`` (a DFlashProposer) over the
    output positions of ``samples`` but the first (module docstring); ``batch_size`` samples
    share each block forward (``propose_many``)."""
    hits = [0] * depth
    total = 0
    samples = [s for s in samples if s.num_output_tokens > 1]
    for lo in range(0, len(samples), batch_size):
        group = samples[lo:lo + batch_size]
        names = [f"eval-{lo + i}" for i in range(len(group))]
        for name, s in zip(names, group):
            proposer.open(name, s.token_ids[:s.prompt_len + 1])
            proposer.observe_seed_state(name, s.prompt_len - 1, s.features.float())
        nxt = [s.prompt_len + 1 for s in group]
        while True:
            act = [i for i, s in enumerate(group) if nxt[i] < len(s.token_ids)]
            if not act:
                break
            out = proposer.propose_many([ProposeCall(names[i], group[i].token_ids[:nxt[i]],
                                                     depth) for i in act])
            for i, (drafts, _) in zip(act, out):
                ids = group[i].token_ids
                for k in range(depth):
                    if (k >= len(drafts) or nxt[i] + k >= len(ids)
                            or drafts[k] != ids[nxt[i] + k]):
                        break
                    hits[k] += 1
                total += 1
                nxt[i] += 1
        for name in names:
            proposer.close(name)
    return [h / max(total, 1) for h in hits]
