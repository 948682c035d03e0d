"""Where each draft's confidence comes from, for the confidence budget
(decode/confidence_budget.py; pure Python, no torch import).

Per draft, in order of preference:

1. ``head``: the drafter's own survival prediction, DraftTailStream.draft_confidences (a
   trained confidence head, DSpark's), used as sent. Kept per request by output position and
   token (:class:`TokenScores`), beside the tail buffer, so a segment that replaces drafts
   replaces their confidences and a stale one never matches a different token;
2. ``q``: the draft's probability under the distribution it was drawn from: from its row
   (DraftTailStream.draft_probs: EAGLE, draft-model and PARD send them for unseeded sampled
   requests) or sent alone (DraftTailStream.draft_token_probs: draft-model and PARD for
   greedy requests, kept like the head's), mapped through the verifier's online calibration
   per (draft method, request's sampling mode, position) (decode/confidence_calibration.py):
   a greedy draft survives when it is the target's argmax, a sampled one with ``min(1, p /
   q)``, so the two calibrate apart;
3. ``rate``: the request's measured acceptance (decode/goodput.py ``Acceptance.rate``), the
   per-request estimate the goodput policy uses today: a drafter that sends neither a head's
   confidences nor rows is scored as before (``rate ** j`` for the ``j``-th draft).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specmesh.decode.confidence_calibration import ConfidenceCalibration, clamp_confidence

#: Kinds of a draft's confidence (module doc).
HEAD, Q, RATE = "head", "q", "rate"


@dataclass
class TokenScores:
    """A request's per-draft scores sent beside its drafts (a head's confidences, or greedy
    drafts' probabilities): output position -> (draft token, score)."""

    by_position: dict[int, tuple[int, float]] = field(default_factory=dict)

    def add(self, start_pos: int, token_ids: Sequence[int], confidences: Sequence[float]) -> None:
        """A segment's scores (one per token; none: nothing kept)."""
        for j, (t, c) in enumerate(zip(token_ids, confidences)):
            self.by_position[start_pos + j] = (int(t), clamp_confidence(c))

    def lookup(self, committed_len: int, drafts: Sequence[int]) -> list[float | None]:
        """The score of each draft at output positions ``committed_len, ...`` (None where
        none was sent for that token there). Forgets positions already committed."""
        for pos in [p for p in self.by_position if p < committed_len]:
            del self.by_position[pos]
        out: list[float | None] = []
        for j, t in enumerate(drafts):
            got = self.by_position.get(committed_len + j)
            out.append(got[1] if got is not None and got[0] == t else None)
        return out


@dataclass(frozen=True)
class StepConfidences:
    """One request's confidences at plan time: per usable draft, the ``used`` confidence
    (what the budget multiplies), its ``kinds`` and the ``raw`` score (the calibration's
    input for ``q``, under ``key``)."""

    used: list[float]
    kinds: list[str]
    raw: list[float]
    key: str = ""


class DraftConfidences:
    """Scores each request's usable drafts (module doc) and learns the ``q`` calibration
    from the verify outcomes.

    ``method``: the deployment's draft method (VerifierConfig.draft_method), which keys the
    calibration tables."""

    def __init__(self, method: str = "", calibration: ConfidenceCalibration | None = None
                 ) -> None:
        self.method = method
        self.calibration = calibration or ConfidenceCalibration()

    def q_key(self, mode: str = "") -> str:
        """The calibration key of this method's raw ``q`` scores for requests of sampling
        ``mode`` (e.g. ``greedy``, ``random``)."""
        return f"{self.method}:q:{mode}"

    def score(self, drafts: Sequence[int], rows: Sequence[object | None],
              head: Sequence[float | None], rate: float,
              token_probs: Sequence[float | None] = (), mode: str = "") -> StepConfidences:
        """Confidences of ``drafts`` (a request's usable tail, in order).

        Args:
            drafts: the draft token ids.
            rows: per draft its probability row (anything indexable by token id, e.g. a
                float32 ``[vocab_size]`` tensor) or None; may be shorter than ``drafts``.
            head: per draft its head confidence or None (:meth:`TokenScores.lookup`).
            rate: the request's acceptance rate, for drafts with none of the others.
            token_probs: per draft its probability sent alone
                (DraftTailStream.draft_token_probs) or None.
            mode: the request's sampling mode, which keys the ``q`` calibration.
        """
        used, kinds, raw = [], [], []
        qs = []
        for j, t in enumerate(drafts):
            h = head[j] if j < len(head) else None
            row = rows[j] if j < len(rows) else None
            tp = token_probs[j] if j < len(token_probs) else None
            if h is not None:
                kinds.append(HEAD)
                raw.append(h)
            elif row is not None or tp is not None:
                kinds.append(Q)
                raw.append(clamp_confidence(float(row[t]) if row is not None else tp))
                qs.append(j)
            else:
                kinds.append(RATE)
                raw.append(clamp_confidence(rate))
            used.append(raw[-1])
        key = self.q_key(mode)
        for j in qs:  # the calibrated survival probability at the draft's position
            used[j] = self.calibration.calibrated(key, j, raw[j])
        return StepConfidences(used, kinds, raw, key)

    def observe(self, conf: StepConfidences, num_drafts: int, accept_len: int) -> None:
        """A step verified the first ``num_drafts`` drafts scored by ``conf`` and accepted
        ``accept_len``: each judged ``q`` draft's outcome goes into its position's
        calibration table."""
        n = min(num_drafts, len(conf.raw))
        a = max(min(accept_len, n), 0)
        for j in range(min(a + 1, n)):
            if conf.kinds[j] == Q:
                self.calibration.observe_draft(conf.key, j, conf.raw[j], j < a)


__all__ = ["HEAD", "Q", "RATE", "DraftConfidences", "StepConfidences", "TokenScores"]
