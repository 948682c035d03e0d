"""A request's penalties and token constraints at every position it samples or verifies
(issue 33 item 3): ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
``logit_bias``, ``min_tokens``, ``bad_words``, ``allowed_token_ids``
(protocol.messages.SamplingParams; vLLM's semantics, kernels/logits_penalties.py).

Each logits row is processed with the state of the tokens committed *before its position*:
the verify step's row ``i`` of a request with drafts ``d_0 .. d_{k-1}`` sees the output
``committed + d_0 .. d_{i-1}`` (a tree node's row: the drafts on its path), so a penalty sees
every accepted draft of a run, not only the last one (vLLM #18902), and the processed rows
equal those of plain decoding position by position. The prefill worker's first token sees the
prompt and an empty output; a model drafter processes its draft logits the same way so that it
drafts from the distribution the verifier verifies against.

Callers describe each processed request by a :class:`RowsHistory` and call
:func:`apply_logits_processors`; requests without processors
(``SamplingParams.has_logits_processors`` false) are simply left out (no cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh.kernels.logits_penalties import PenaltyInputs, apply_penalties_, token_counts
from specmesh.protocol.messages import SamplingParams


@dataclass(frozen=True)
class RowsHistory:
    """Consecutive logits rows ``first_row .. first_row + len(row_drafts) - 1`` of one request.

    ``output_token_ids``: the output committed before the first row (output position
    ``len(output_token_ids)`` is what row 0 predicts); ``row_drafts[i]``: the drafts between
    that and row ``i``'s position (``[]`` for row 0; a chain's row ``i``: ``drafts[:i]``).
    """

    sampling: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    first_row: int
    row_drafts: Sequence[Sequence[int]] = ((),)


def chain_row_drafts(draft_token_ids: Sequence[int]) -> list[list[int]]:
    """``row_drafts`` of a chain of drafts: row ``i`` follows ``drafts[:i]`` (``k + 1`` rows)."""
    d = list(draft_token_ids)
    return [d[:i] for i in range(len(d) + 1)]


def tree_row_drafts(draft_token_ids: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """``row_drafts`` of a draft tree (kernels/tree_layout.py: ``parents[j] < j``, -1 the
    root): row 0 follows nothing, row ``1 + j`` the path root -> node ``j`` (itself included)."""
    paths: list[list[int]] = []
    for j, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [int(draft_token_ids[j])])
    return [[]] + paths


def stop_ids_under_min_tokens(sampling: SamplingParams) -> list[int]:
    """The ids ``min_tokens`` keeps away (vLLM: the request's stop_token_ids and, unless
    ``ignore_eos``, the EOS ids the verifier filled into ``sampling.eos_token_ids``)."""
    ids = list(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        ids += list(sampling.eos_token_ids)
    return sorted(set(ids))


def banned_ids(sampling: SamplingParams, output: Sequence[int],
               num_output: int | None = None) -> list[int]:
    """Ids masked after ``output`` (the output tokens before the position, or only their
    tail when ``num_output`` gives the full count): EOS / stop ids while the count is below
    ``min_tokens``; each bad word's last token when the output ends with the word's other
    tokens (vLLM's ``apply_bad_words``: a one-token word is always banned)."""
    out: list[int] = []
    if (len(output) if num_output is None else num_output) < sampling.min_tokens:
        out += stop_ids_under_min_tokens(sampling)
    n = len(output)
    for word in sampling.bad_words_token_ids:
        prefix = len(word) - 1
        if prefix > n:
            continue
        if prefix == 0 or list(output[n - prefix:]) == list(word[:prefix]):
            out.append(int(word[-1]))
    return out


def penalty_inputs(histories: Sequence[RowsHistory], vocab_size: int,
                   device: torch.device | str = "cpu") -> PenaltyInputs:
    """The kernel inputs of every row of ``histories`` (kernels/logits_penalties.py).

    Count tensors take one scatter per kind for the whole batch: each request's committed
    output (and prompt) once into a per-request row, repeated to the request's rows, then each
    row's drafts added; no loop over the vocabulary, no copy of the output per row.
    """
    rows: list[int] = []
    row_request: list[int] = []  # processed row -> index into histories
    presence: list[float] = []
    frequency: list[float] = []
    repetition: list[float] = []
    base_idx: list[int] = []  # (request, token) pairs of committed output tokens
    base_tok: list[int] = []
    prompt_idx: list[int] = []  # (request, token) pairs of prompt tokens (repetition only)
    prompt_tok: list[int] = []
    draft_idx: list[int] = []  # (processed row, token) pairs of the drafts before the row
    draft_tok: list[int] = []
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    ban: tuple[list[int], list[int]] = ([], [])
    allow: tuple[list[int], list[int]] = ([], [])
    for q, h in enumerate(histories):
        s = h.sampling
        out = h.output_token_ids
        counted = bool(s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0)
        if counted:
            base_idx += [q] * len(out)
            base_tok += list(out)
        if s.repetition_penalty != 1.0:
            prompt_idx += [q] * len(h.prompt_token_ids)
            prompt_tok += list(h.prompt_token_ids)
        # bad words look back at most their length; min_tokens needs the length only
        longest = max((len(w) for w in s.bad_words_token_ids), default=1)
        tail = list(out[max(0, len(out) - longest):])
        for i, drafts in enumerate(h.row_drafts):
            r = len(rows)
            rows.append(h.first_row + i)
            row_request.append(q)
            presence.append(float(s.presence_penalty))
            frequency.append(float(s.frequency_penalty))
            repetition.append(float(s.repetition_penalty))
            drafts = [int(t) for t in drafts]
            if counted:
                draft_idx += [r] * len(drafts)
                draft_tok += drafts
            if s.logit_bias_token_ids:
                bias[0].extend([r] * len(s.logit_bias_token_ids))
                bias[1].extend(s.logit_bias_token_ids)
                bias[2].extend(float(v) for v in s.logit_bias_values)
            banned = banned_ids(s, tail + drafts, len(out) + len(drafts))
            ban[0].extend([r] * len(banned))
            ban[1].extend(banned)
            if s.allowed_token_ids is not None:
                allow[0].extend([r] * len(s.allowed_token_ids))
                allow[1].extend(s.allowed_token_ids)

    def longs(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    n, q = len(rows), len(histories)
    counts = seen = None
    by_row = longs(row_request).to(device)
    if base_idx or draft_idx:
        counts = token_counts(longs(base_idx), longs(base_tok), q, vocab_size, device)
        counts = counts.index_select(0, by_row)
        if draft_idx:
            counts += token_counts(longs(draft_idx), longs(draft_tok), n, vocab_size, device)
    if any(h.sampling.repetition_penalty != 1.0 for h in histories):
        seen = token_counts(longs(prompt_idx), longs(prompt_tok), q, vocab_size, device) > 0
        seen = seen.index_select(0, by_row)
        if counts is not None:
            seen |= counts > 0  # prompt or output
    elif counts is not None and not any(h.sampling.presence_penalty
                                         or h.sampling.frequency_penalty for h in histories):
        counts = None
    return PenaltyInputs(
        rows=longs(rows), presence=torch.tensor(presence, dtype=torch.float32),
        frequency=torch.tensor(frequency, dtype=torch.float32),
        repetition=torch.tensor(repetition, dtype=torch.float32),
        output_counts=counts, seen=seen,
        bias_index=longs(bias[0]), bias_ids=longs(bias[1]),
        bias_values=torch.tensor(bias[2], dtype=torch.float32),
        ban_index=longs(ban[0]), ban_ids=longs(ban[1]),
        allow_index=longs(allow[0]), allow_ids=longs(allow[1]))


def apply_logits_processors(logits: torch.Tensor, histories: Sequence[RowsHistory]
                            ) -> torch.Tensor:
    """Process the rows ``histories`` name, in place, with their requests' penalties and token
    constraints (module docstring); other rows are untouched. Returns ``logits`` [N, V].

    Raises:
        ValueError: rows outside ``logits``, or token ids outside its vocabulary (the
            verifier and the prefill worker refuse such requests at admission,
            SamplingParams.vocab_reason).
    """
    histories = [h for h in histories if h.sampling.has_logits_processors]
    if not histories:
        return logits
    n, vocab = logits.shape
    last = max(h.first_row + len(h.row_drafts) for h in histories)
    if min(h.first_row for h in histories) < 0 or last > n:
        raise ValueError(f"rows up to {last} for {n} logits rows")
    for h in histories:
        why = h.sampling.vocab_reason(vocab)
        if why:
            raise ValueError(why)
    return apply_penalties_(logits, penalty_inputs(histories, vocab, logits.device))


__all__ = ["RowsHistory", "apply_logits_processors", "banned_ids", "chain_row_drafts",
           "penalty_inputs", "stop_ids_under_min_tokens", "tree_row_drafts"]
