"""The optimiser steps of a block drafter's training (PARD, DFlash, DSpark): AdamW with a
warm-up and cosine schedule (:func:`drafter.draft_model_training.optimizer_and_schedule`) over
batches of whole samples, reshuffled every epoch, for a planned number of steps or until a
time bound (``--train-minutes``) passes; a progress bar; the summary every trainer records.

Usage::

    steps = TrainSteps(params, samples, epochs=..., batch_size=..., lr=..., warmup_steps=...,
                       seed=..., max_seconds=..., desc="train pard", progress=True)
    for batch in steps:          # the learning rate of this step is set
        loss, rows = ...         # the method's loss over ``batch``
        steps.update(loss, rows)  # backward, clip, optimiser step (skip it: no step taken)
    summary = steps.summary()
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from tqdm import tqdm

from specmesh.drafter.draft_model_training import optimizer_and_schedule
from specmesh.drafter.eagle.data import shuffled

#: Gradient-norm clip of every step.
CLIP_NORM = 1.0


class TrainSteps:
    """Batches of ``samples`` (``batch_size`` whole samples each) for ``total_steps``
    optimiser steps (``epochs`` of them, may be fractional), reshuffled each epoch with
    ``seed + epoch``, stopped early once ``max_seconds`` have passed (None: no bound)."""

    def __init__(self, params: list[torch.Tensor], samples: list, *, epochs: float,
                 batch_size: int, lr: float, warmup_steps: int, seed: int,
                 max_seconds: float | None, desc: str, progress: bool) -> None:
        self.params = params
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self.max_seconds = max_seconds
        self.opt, self.total_steps, self.lr_at = optimizer_and_schedule(
            params, len(samples), epochs=epochs, batch_size=batch_size, lr=lr,
            warmup_steps=warmup_steps)
        self.steps = 0
        self.rows = 0
        self.loss = float("nan")
        self.stopped_early = False
        self.t0 = time.perf_counter()
        self._bar = tqdm(total=self.total_steps, desc=desc, unit="step", disable=not progress)

    def __iter__(self) -> Iterator[list]:
        self.t0 = time.perf_counter()
        epoch = 0
        try:
            while self.steps < self.total_steps and not self.stopped_early:
                order = shuffled(self.samples, self.seed + epoch)
                epoch += 1
                for lo in range(0, len(order), self.batch_size):
                    if self.steps >= self.total_steps:
                        break
                    if self.max_seconds is not None and \
                            time.perf_counter() - self.t0 > self.max_seconds:
                        self.stopped_early = True
                        break
                    for g in self.opt.param_groups:
                        g["lr"] = self.lr_at(self.steps)
                    yield order[lo:lo + self.batch_size]
        finally:
            self._bar.close()

    def update(self, loss: torch.Tensor, rows: int, **shown: Any) -> None:
        """One optimiser step on ``loss`` (backward, gradient clip, step) that labelled
        ``rows`` rows; ``shown``: more figures for the progress bar."""
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP_NORM)
        self.opt.step()
        self.rows += rows
        self.steps += 1
        self.loss = float(loss.detach())
        self._bar.set_postfix(loss=f"{self.loss:.3f}", **shown,
                              rows_s=f"{self.rows / (time.perf_counter() - self.t0):.0f}")
        self._bar.update(1)

    def summary(self) -> dict:
        """``steps``, ``planned_steps``, ``stopped_at_time_limit``, ``seconds``,
        ``labelled_rows_per_s`` and ``last_loss`` (None before any step)."""
        secs = time.perf_counter() - self.t0
        return {"steps": self.steps, "planned_steps": self.total_steps,
                "stopped_at_time_limit": self.stopped_early, "seconds": round(secs, 1),
                "labelled_rows_per_s": round(self.rows / max(secs, 1e-9), 1),
                "last_loss": round(self.loss, 4) if math.isfinite(self.loss) else None}


__all__ = ["CLIP_NORM", "TrainSteps"]
