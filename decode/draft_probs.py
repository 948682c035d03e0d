"""Draft probabilities on the verifier: checking the rows a drafter sends and laying them out for
a verification rule (docs/architecture.md, 'Verification rules').

A drafter that samples its drafts sends, per draft, the dense distribution it sampled from
(``DraftTailStream.draft_probs``, float32 ``[n, vocab_size]``: 192 KB per row at V = 49,152,
fine on loopback, and sent only for requests whose rule uses them). The rules that use them
(rejection sampling, block verification) are exact for any row that really is the distribution
the draft was drawn from, and also for one-hot rows (a draft treated as given: it passes with
probability ``target_probs[x]`` and the recovered token comes from the target without ``x``),
whatever the drafter actually did. So a request whose buffered drafts lack rows, in a batch
where another request's have them, gets one-hot rows: one batch, one kernel call, no regrouping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.engine.frames import buffer_to_tensor
from specmesh.protocol.messages import Buffer

#: most a row may miss summing to 1 (float32 sums over a 49,152 vocabulary drift ~1e-5)
ROW_SUM_TOLERANCE = 1e-3


def checked_draft_probs(buf: Buffer, draft_token_ids: Sequence[int],
                        vocab_size: int) -> torch.Tensor:
    """The rows of ``buf`` as float32 ``[n, vocab_size]`` (CPU), after checking that they are
    the distributions ``draft_token_ids`` were drawn from could be.

    Raises:
        ValueError: not float32/float64, not ``[len(draft_token_ids), vocab_size]``, a value
            that is negative or not finite, a row that does not sum to 1 (within
            :data:`ROW_SUM_TOLERANCE`), or a draft whose own probability is 0 (it cannot have
            been drawn from its row).
    """
    n = len(draft_token_ids)
    if buf.dtype not in ("float32", "float64"):
        raise ValueError(f"draft_probs must be float32 or float64, got {buf.dtype}")
    if tuple(buf.shape) != (n, vocab_size):
        raise ValueError(f"draft_probs of shape {list(buf.shape)}, want [{n}, {vocab_size}]")
    probs = buffer_to_tensor(buf).to(torch.float32)
    if n == 0:
        return probs
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise ValueError("draft_probs must be finite and >= 0")
    sums = probs.sum(dim=1, dtype=torch.float64)
    if bool(((sums - 1).abs() > ROW_SUM_TOLERANCE).any()):
        raise ValueError(f"draft_probs rows must sum to 1, got {sums.tolist()}")
    ids = torch.tensor(list(draft_token_ids), dtype=torch.long)
    if bool((probs.gather(1, ids[:, None]) <= 0).any()):
        raise ValueError("a draft token has probability 0 in its own draft_probs row")
    return probs


def batch_draft_probs(draft_token_ids: Sequence[int], rows: Sequence[torch.Tensor | None],
                      vocab_size: int, device: torch.device | str = "cpu",
                      ) -> torch.Tensor | None:
    """float32 ``[len(draft_token_ids), vocab_size]`` for a rule batch: each draft's row, a
    one-hot row at the draft where it has none (module docstring); None when no draft has a
    row (the rules' one-hot path, no dense tensor at all).

    Raises:
        ValueError: ``rows`` not aligned with ``draft_token_ids``.
    """
    if len(rows) != len(draft_token_ids):
        raise ValueError(f"{len(rows)} draft_probs rows for {len(draft_token_ids)} drafts")
    if all(r is None for r in rows):
        return None
    out = torch.zeros((len(rows), vocab_size), dtype=torch.float32)
    for i, (tok, r) in enumerate(zip(draft_token_ids, rows)):
        if r is None:
            out[i, tok] = 1.0
        else:
            out[i] = r
    return out.to(device)


__all__ = ["ROW_SUM_TOLERANCE", "batch_draft_probs", "checked_draft_probs"]
