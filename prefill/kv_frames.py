"""The KVFrames that carry one prefilled prompt's KV to its verifier (docs/architecture.md,
'KV transfer'): at most ``frame_tokens`` tokens x ``frame_layers`` layers each, stamped with
(request id, transfer id, layer range, chunk index), in chunk order, sent paced by
``max_kv_send_mb_s``."""

from __future__ import annotations

import time
from collections.abc import Callable

from specmesh.engine.frames import tensor_to_buffer
from specmesh.engine.kv_cache import KVCache
from specmesh.prefill.config import PrefillConfig
from specmesh.protocol.messages import KVFrame, PrefillRequest


def kv_frames(cache: KVCache, num_layers: int, config: PrefillConfig,
              req: PrefillRequest, block_table: list[int], n: int) -> list[KVFrame]:
    """The KVFrames of ``req``'s first ``n`` prompt tokens, read from ``cache`` (the worker's
    KV cache, engine/kv_cache.py) through ``block_table``."""
    frames: list[KVFrame] = []
    for token_start in range(0, n, config.frame_tokens):
        num_tokens = min(config.frame_tokens, n - token_start)
        for layer_start in range(0, num_layers, config.frame_layers):
            layer_end = min(layer_start + config.frame_layers, num_layers)
            kv = cache.read_chunk(layer_start, layer_end, block_table, token_start, num_tokens)
            frames.append(KVFrame(
                request_id=req.request_id, transfer_id=req.transfer_id,
                layer_start=layer_start, layer_end=layer_end, chunk_index=len(frames),
                token_start=token_start, num_tokens=num_tokens, kv=tensor_to_buffer(kv)))
    return frames


def send_frames(send: Callable[[str, KVFrame], None], peer: str, frames: list[KVFrame],
                max_kv_send_mb_s: float) -> int:
    """Send one request's frames to ``peer`` with ``send``, paced by ``max_kv_send_mb_s``
    (MiB/s; 0: no cap): frame k leaves no earlier than (bytes of frames 0..k-1) / cap after
    the first, which leaves at once. Returns the bytes sent."""
    rate = max_kv_send_mb_s * (1 << 20)  # bytes/s; 0: no cap
    t0 = time.monotonic()
    num_bytes = 0
    for frame in frames:
        if rate:  # the bytes sent so far may not have left faster than the cap
            time.sleep(max(0.0, t0 + num_bytes / rate - time.monotonic()))
        send(peer, frame)
        num_bytes += frame.kv.nbytes
    return num_bytes
