"""The verify forward's profiled cost: seconds by (batch size, tokens per request), a step
function over buckets, for the goodput policy (decode/goodput.py).

Measured at verifier start (engine/verify_cost_probe.py: real forwards of the runner at a few
batch sizes and widths, cached per model, dtype, KV-cache dtype and CPU by
cluster/verify_cost.py) or loaded from a file (``--verify-cost-table FILE``, the JSON
:meth:`VerifyCostTable.as_dict` writes). A point between measured sizes costs what the next
measured size up costs: execution pads a batch to its bucket (CUDA graphs are captured at a
few batch sizes; a GEMM kernel is picked per size class), and the cost between buckets is
flat then jumps, so a smooth interpolation across buckets predicts costs no step has (the
chapter's warning, "Adaptive speculation": speculation tuned on an interpolated curve
mispredicts exactly at the bucket edges). Past the largest bucket a step runs as several
chunks, so the largest bucket's cost is scaled by the ratio of tokens.

The online EMA of the measured verify forwards (:meth:`VerifyCostTable.observe`) keeps
refining the bucket each step falls in. ``drafter_s_per_draft``: seconds the drafter spends
per draft it makes, counted in a step's cost when the drafter runs on the verifier's cores
(its forwards then delay the verifier's); 0 when unknown. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

#: batch sizes measured at start (buckets: a batch rounds up to the next)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
#: tokens per request measured at start: the request's token and 0, 1, 3, 7 drafts
DEFAULT_WIDTHS = (1, 2, 4, 8)
#: weight of the newest verify forward in a bucket's EMA
TABLE_EMA_WEIGHT = 0.1
#: version of the JSON layout of :meth:`VerifyCostTable.as_dict`
TABLE_FORMAT = 1


@dataclass
class VerifyCostTable:
    """Seconds of one verify forward of ``batch`` requests carrying ``width`` tokens each
    (its last committed token and ``width - 1`` drafts), at every ``(batch, width)`` of
    ``batch_sizes`` x ``widths`` (both ascending, from 1).

    Raises:
        ValueError: empty or unsorted sizes, sizes not starting at 1, a missing or
            non-positive cost, or a negative ``drafter_s_per_draft``.
    """

    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: dict[tuple[int, int], float]
    drafter_s_per_draft: float = 0.0
    #: where the costs come from: ``measured``, ``cached``, a file path, or ``scripted``
    source: str = "scripted"
    num_observed: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        self.batch_sizes = tuple(int(b) for b in self.batch_sizes)
        self.widths = tuple(int(w) for w in self.widths)
        for name, sizes in (("batch_sizes", self.batch_sizes), ("widths", self.widths)):
            if not sizes or sizes[0] != 1 or list(sizes) != sorted(set(sizes)):
                raise ValueError(f"verify cost table: {name} must be ascending distinct sizes "
                                 f"starting at 1, got {list(sizes)}")
        for b in self.batch_sizes:
            for w in self.widths:
                t = self.seconds.get((b, w))
                if t is None or not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
                    raise ValueError(f"verify cost table: no positive cost for batch {b}, "
                                     f"width {w} (got {t!r})")
        if not self.drafter_s_per_draft >= 0:
            raise ValueError(f"verify cost table: drafter_s_per_draft must be >= 0, got "
                             f"{self.drafter_s_per_draft}")

    # -- lookup ---------------------------------------------------------------------------

    @staticmethod
    def _bucket(sizes: tuple[int, ...], n: int) -> int | None:
        """The smallest size >= ``n``, or None past the largest."""
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None

    def bucket(self, batch: int, num_tokens: int) -> tuple[int, int]:
        """The ``(batch, width)`` bucket a forward of ``batch`` requests and ``num_tokens``
        query tokens in all falls in (width: tokens per request, rounded up; each rounded up
        to the next measured size, the largest past it)."""
        batch = max(int(batch), 1)
        width = max(-(-int(num_tokens) // batch), 1)
        b = self._bucket(self.batch_sizes, batch) or self.batch_sizes[-1]
        w = self._bucket(self.widths, width) or self.widths[-1]
        return b, w

    def predict(self, batch: int, num_tokens: int) -> float:
        """Seconds of a verify forward of ``batch`` requests over ``num_tokens`` query tokens:
        its bucket's cost, scaled by the tokens past the bucket's when it is past the largest
        batch or width (no interpolation between buckets)."""
        b, w = self.bucket(batch, num_tokens)
        t = self.seconds[(b, w)]
        return t * max(num_tokens / (b * w), 1.0)

    def step_seconds(self, batch: int, num_drafts: int, drafter_shared: bool = False) -> float:
        """Seconds of a step verifying ``num_drafts`` drafts over ``batch`` requests, the
        drafter's making of them included when it shares the verifier's cores."""
        t = self.predict(batch, batch + num_drafts)
        return t + (self.drafter_s_per_draft * num_drafts if drafter_shared else 0.0)

    # -- online refinement ----------------------------------------------------------------

    def observe(self, batch: int, num_tokens: int, seconds: float) -> None:
        """One verify forward of ``batch`` requests over ``num_tokens`` tokens took
        ``seconds``: its bucket's cost moves towards it (EMA), unless the forward was past
        the largest bucket (scaled there, not measured)."""
        if batch < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        width = -(-num_tokens // batch)
        if batch > self.batch_sizes[-1] or width > self.widths[-1]:
            return
        key = self.bucket(batch, num_tokens)
        self.seconds[key] += TABLE_EMA_WEIGHT * (seconds - self.seconds[key])
        self.num_observed += 1

    # -- files ----------------------------------------------------------------------------

    def as_dict(self) -> dict:
        """The table as JSON (:func:`table_from_dict` reads it back)."""
        return {"format": TABLE_FORMAT, "batch_sizes": list(self.batch_sizes),
                "widths": list(self.widths), "drafter_s_per_draft": self.drafter_s_per_draft,
                "seconds": [[b, w, self.seconds[(b, w)]] for b in self.batch_sizes
                            for w in self.widths]}


def table_from_dict(data: object, source: str = "scripted") -> VerifyCostTable:
    """A table from its JSON form: ``{"batch_sizes": [...], "widths": [...], "seconds":
    [[batch, width, seconds], ...], "drafter_s_per_draft": s}`` (the last optional).

    Raises:
        ValueError: a malformed table (what is wrong, named).
    """
    if not isinstance(data, dict):
        raise ValueError("verify cost table: expected a JSON object")
    try:
        seconds = {(int(b), int(w)): float(t) for b, w, t in data["seconds"]}
        return VerifyCostTable(tuple(data["batch_sizes"]), tuple(data["widths"]), seconds,
                               float(data.get("drafter_s_per_draft", 0.0)), source)
    except (KeyError, TypeError) as err:
        raise ValueError(f"verify cost table: malformed ({err!r}); expected batch_sizes, "
                         f"widths and seconds [[batch, width, seconds], ...]") from None


def load_cost_table(path: str | Path) -> VerifyCostTable:
    """The table in the JSON file ``path`` (``--verify-cost-table FILE``).

    Raises:
        ValueError: the file cannot be read or is not a valid table.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--verify-cost-table {path}: {err}") from None
    return table_from_dict(data, str(path))


__all__ = ["DEFAULT_BATCH_SIZES", "DEFAULT_WIDTHS", "TABLE_EMA_WEIGHT", "VerifyCostTable",
           "load_cost_table", "table_from_dict"]
