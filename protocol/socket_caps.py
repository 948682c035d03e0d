"""The per-message size cap of a role's sockets (``ZMQ_MAXMSGSIZE``), sized from the largest
message part a roster peer legitimately sends: a peer that sends a larger one is disconnected
by ZMQ before the part is buffered, so no peer can make a role hold an arbitrary amount of
memory per message.

The largest parts (protocol/messages.py):

- a KVFrame's ``kv`` buffer: ``[frame_layers, 2, frame_tokens, num_kv_heads, head_dim]`` in
  the KV cache dtype (the prefill worker's ``frame_layers`` x ``frame_tokens``);
- a DraftTailStream's ``draft_probs``: ``[drafts, vocab_size]`` float32, drafts at most the
  drafter's window;
- a header frame (token lists, corpus chunks): at most the codec's ``MAX_HEADER_BYTES``.

The cap is twice the largest of those (room for a small change of layout), at least
``MIN_MESSAGE_BYTES``.
"""

from __future__ import annotations

from specmesh.protocol.codec import MAX_HEADER_BYTES
from specmesh.protocol.messages import DTYPE_ITEMSIZE, ModelIdentity

#: no role's cap is below this (the codec's largest header and some room)
MIN_MESSAGE_BYTES = 2 * MAX_HEADER_BYTES
#: bytes per draft probability (float32)
PROB_BYTES = 4


def kv_frame_bytes(model: ModelIdentity, frame_tokens: int, frame_layers: int) -> int:
    """Bytes of the largest KVFrame buffer of ``model`` under these frame settings."""
    layers = min(frame_layers, model.num_layers)
    return (layers * 2 * frame_tokens * model.num_kv_heads * model.head_dim
            * DTYPE_ITEMSIZE[model.kv_cache_dtype])


def max_message_bytes(model: ModelIdentity, frame_tokens: int, frame_layers: int,
                      max_drafts: int) -> int:
    """The ZMQ_MAXMSGSIZE of a role of ``model`` whose prefill frames hold ``frame_tokens`` x
    ``frame_layers`` and whose drafter sends at most ``max_drafts`` draft rows a segment."""
    largest = max(MAX_HEADER_BYTES, kv_frame_bytes(model, frame_tokens, frame_layers),
                  max_drafts * model.vocab_size * PROB_BYTES)
    return max(MIN_MESSAGE_BYTES, 2 * largest)
