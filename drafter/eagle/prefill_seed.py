"""The EAGLE head's first draft step across prefill -> decode (docs/drafters.md, 'The seed
across P/D'): the prefill runs the head's entry at the last prompt position and ships it as a
:class:`~protocol.messages.DraftSeed`; the drafter installs it in the request's head state
instead of running that entry itself.

SGLang's P/D EAGLE is the model: its prefill runs the draft extend over the prompt and ships
per request the first draft step's top-k (``output_topk_p`` / ``output_topk_index``, 16
slots), the draft's hidden state (``MetadataBuffers``, ``disaggregation/utils.py``) and the
draft KV, so decode's first round recomputes nothing. Here the entry at ``p - 1`` (a
``p``-token prompt) reads the target's seed state there and the first output token; its
output state, its K/V in every head layer and the top-k of its draft distribution (target
ids) make the seed. A multi-layer head's seed is module 0's entry; modules 1.. catch up as
they do without one (they have nothing to run before the first draft round).

Both functions work on an :class:`~drafter.proposers.eagle.EagleProposer` (its request
states, head and catch-up), which exposes them as ``make_prefill_seed`` /
``adopt_prefill_seed``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from specmesh.drafter.eagle.head_kv import HeadKV
from specmesh.drafter.proposer import ProposeCall
from specmesh.engine.dtypes import dtype_name
from specmesh.engine.frames import buffer_to_tensor, tensor_to_buffer
from specmesh.protocol.messages import MAX_DRAFT_SEED_TOPK, DraftSeed

#: a ``drafter.proposers.eagle.EagleProposer`` (not imported: it imports this module)
EagleProposer = Any

log = logging.getLogger(__name__)

#: prefix of the temporary request key a prefill-side seed is computed under (never a request
#: id of the wire: those never hold a NUL)
_TEMP_KEY = "\0prefill-seed:"


def make_seed(prop: EagleProposer, request_id: str, context_token_ids: list[int],
              hidden: torch.Tensor, topk: int) -> DraftSeed | None:
    """The seed of a request whose context is ``context_token_ids`` (the prompt and its first
    output token, ``p + 1`` tokens) and whose target seed state at ``p - 1`` is ``hidden``
    (``[1, seed_width]``, the rows PrefillDone.seed_state carries): one head entry run on a
    temporary request state (opened and closed here), its output state, K/V and the ``topk``
    likeliest tokens of its draft distribution (capped at MAX_DRAFT_SEED_TOPK and the draft
    vocabulary; float32 softmax of the head's logits). None when the context is shorter than
    two tokens.

    Raises:
        ValueError: rows the head cannot read (another width).
    """
    ctx = list(context_token_ids)
    if len(ctx) < 2 or hidden.shape[0] != 1:
        return None
    key = _TEMP_KEY + request_id
    pos = len(ctx) - 2
    prop.open(key, ctx)
    try:
        prop.observe_seed_state(key, pos, hidden)
        with torch.inference_mode():
            prop._catch_up(prop._cursors([ProposeCall(key, ctx, 1)]), chain=False)
            st = prop.states[key]
            if st.kv.length != 1 or st.kv.start != pos:
                return None
            g = st.outs[0]
            kv = torch.stack([torch.stack([k[:, :1], v[:, :1]])
                              for k, v in zip(st.kv.keys, st.kv.values)])
            head = prop.head
            probs = torch.softmax(head.logits(g[None]).float(), dim=-1)[0]
            top = probs.topk(max(1, min(topk, MAX_DRAFT_SEED_TOPK, probs.numel())))
            ids = head.target_ids(top.indices).tolist()
        return DraftSeed(position=pos, token_id=ctx[-1], topk_ids=[int(t) for t in ids],
                         topk_probs=[float(q) for q in top.values],
                         draft_hidden=tensor_to_buffer(g[None].clone()),
                         draft_kv=tensor_to_buffer(kv.contiguous()))
    finally:
        prop.close(key)


def seed_fit_error(prop: EagleProposer, request_id: str, context_token_ids: list[int],
                   seed: DraftSeed) -> str:
    """Why ``seed`` cannot be installed in ``request_id``'s head state ("" when it can): no
    such request, a head KV that already holds entries, true states that do not start at the
    seed's position, a position or token other than the context's, or buffers whose dtype or
    shape is not the head's."""
    st = prop.states.get(request_id)
    ctx = context_token_ids
    pos = seed.position
    if st is None:
        return "no such request"
    if st.kv.length:
        return "its head KV holds entries already"
    if st.feats_start != pos or st.feats_end <= pos:
        return f"its true states start at {st.feats_start}, the seed's entry is at {pos}"
    if not 0 <= pos < len(ctx) - 1 or ctx[pos + 1] != seed.token_id:
        return f"the seed read token {seed.token_id} at {pos + 1}, not the context's"
    c = prop.head.config
    want_dtype = dtype_name(prop.head.fc.weight.dtype)
    want_kv = (c.num_layers, 2, c.num_kv_heads, 1, c.head_dim)
    for name, buf, shape in (("draft_hidden", seed.draft_hidden, (1, c.hidden_size)),
                             ("draft_kv", seed.draft_kv, want_kv)):
        if buf.dtype != want_dtype or tuple(buf.shape) != shape:
            return (f"{name} {buf.dtype}{list(buf.shape)}, the head's is "
                    f"{want_dtype}{list(shape)}")
    return ""


def adopt_seed(prop: EagleProposer, request_id: str, context_token_ids: list[int],
               seed: DraftSeed) -> bool:
    """Install ``seed`` in ``request_id``'s head state (after its true states were observed):
    the entry's K/V at the seed's position, the token it read and its output state, as if
    the proposer had run that entry (so its catch-up does not). False, changing nothing,
    when it does not fit (:func:`seed_fit_error`) or its buffers hold a value that is not
    finite; logged."""
    why = seed_fit_error(prop, request_id, context_token_ids, seed)
    if not why:
        try:
            g = buffer_to_tensor(seed.draft_hidden).clone()[0]
            kv = buffer_to_tensor(seed.draft_kv).clone()
        except ValueError as err:
            why = str(err)
        else:
            if not (torch.isfinite(g).all() and torch.isfinite(kv).all()):
                why = "a value that is not finite"
    if why:
        log.warning("draft seed of %s refused: %s", request_id, why)
        return False
    st = prop.states[request_id]
    head_kv = HeadKV(start=seed.position)
    for li in range(kv.shape[0]):
        head_kv.write(li, kv[li, 0], kv[li, 1])
    head_kv.commit(1)
    st.kv, st.entry_tokens, st.outs = head_kv, [seed.token_id], [g]
    return True


__all__ = ["adopt_seed", "make_seed", "seed_fit_error"]
