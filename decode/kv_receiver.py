"""Receiving side of the KV transfer (docs/architecture.md, 'KV transfer').

A transfer is complete when its PrefillDone and all the KVFrames it announces have arrived, in
either order (the prefill worker sends PrefillDone first, so the first token it carries can be
streamed while the frames arrive). Frames land directly in the destination blocks. A cancelled
transfer keeps its blocks until the prefill side acknowledges the cancel; frames of unknown
(finished, cancelled and acknowledged) transfer ids are dropped, so a late frame never touches
blocks that another request owns: transfer ids are never reused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specmesh.engine.frames import buffer_to_tensor
from specmesh.engine.kv_cache import KVCache
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import KVFrame, PrefillDone


@dataclass
class Transfer:
    request_id: str
    transfer_id: int
    prefill_peer: str
    block_table: list[int]
    prompt_len: int
    started_at: float = field(default_factory=time.monotonic)
    num_frames: int = 0
    num_bytes: int = 0
    done: PrefillDone | None = None
    cancelled: bool = False
    cancelled_at: float | None = None  # monotonic time of the cancel
    ingest_s: float = 0.0  # seconds this side spent checking and writing its frames

    @property
    def complete(self) -> bool:
        d = self.done
        return (d is not None and not d.error and self.num_frames == d.num_frames
                and self.num_bytes == d.num_bytes)


@dataclass
class KVReceiverStats:
    num_frames: int = 0
    num_bytes: int = 0
    num_late_frames: int = 0  # for unknown or cancelled transfers, dropped
    num_orphaned: int = 0  # transfers whose prefill peer can send nothing more (gone, restarted)
    num_completed: int = 0
    transfer_seconds: float = 0.0


class KVReceiver:
    """Tracks in-flight transfers into ``kv_cache``."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.transfers: dict[int, Transfer] = {}
        self.stats = KVReceiverStats()

    def start(self, request_id: str, transfer_id: int, prefill_peer: str, block_table: list[int],
              prompt_len: int) -> Transfer:
        if transfer_id in self.transfers:
            raise ValueError(f"transfer id {transfer_id} reused")
        t = Transfer(request_id, transfer_id, prefill_peer, block_table, prompt_len)
        self.transfers[transfer_id] = t
        return t

    def on_frame(self, peer: str, frame: KVFrame) -> Transfer | None:
        """Write one frame; returns the transfer when this frame completed it.

        Raises:
            ProtocolError: the frame does not fit its transfer (layer or token range, shape,
                dtype); only that request fails. A frame naming a transfer of another peer, or
                another request, is refused without failing the transfer it names (matched by
                sender: a peer cannot end a transfer it does not serve).
        """
        t = self.transfers.get(frame.transfer_id)
        if t is None or t.cancelled:
            self.stats.num_late_frames += 1
            return None
        rid = t.request_id
        if peer != t.prefill_peer or frame.request_id != rid:
            raise ProtocolError(f"KV frame for transfer {t.transfer_id} from the wrong sender "
                                f"{peer} (request {frame.request_id!r})")
        cfg = self.kv_cache.config
        if not (0 <= frame.layer_start < frame.layer_end <= cfg.num_layers):
            raise ProtocolError(f"bad layer range [{frame.layer_start}, {frame.layer_end})",
                                request_id=rid)
        if not (0 <= frame.token_start and frame.num_tokens > 0
                and frame.token_start + frame.num_tokens <= t.prompt_len):
            raise ProtocolError(f"bad token range {frame.token_start}+{frame.num_tokens} for a "
                                f"{t.prompt_len}-token prompt", request_id=rid)
        want = (frame.layer_end - frame.layer_start, 2, frame.num_tokens, cfg.num_kv_heads,
                cfg.head_dim)
        if tuple(frame.kv.shape) != want:
            raise ProtocolError(f"KV frame shape {tuple(frame.kv.shape)} != {want}",
                                request_id=rid)
        t0 = time.perf_counter()
        try:
            kv = buffer_to_tensor(frame.kv)
            if kv.dtype != self.kv_cache.dtype:
                raise ValueError(f"KV dtype {kv.dtype} != cache dtype {self.kv_cache.dtype}")
            self.kv_cache.write_chunk(frame.layer_start, frame.layer_end, t.block_table,
                                      frame.token_start, kv)
        except ValueError as err:
            raise ProtocolError(f"KV frame rejected: {err}", request_id=rid) from err
        t.ingest_s += time.perf_counter() - t0
        t.num_frames += 1
        t.num_bytes += frame.kv.nbytes
        self.stats.num_frames += 1
        self.stats.num_bytes += frame.kv.nbytes
        return self._finish_if_complete(t)

    def on_done(self, peer: str, done: PrefillDone) -> Transfer | None:
        """Record PrefillDone; returns the transfer when it is complete or failed.

        Raises:
            ProtocolError: a PrefillDone naming a transfer of another peer or request (the
                transfer it names is left as it is).
        """
        t = self.transfers.get(done.transfer_id)
        if t is None or t.cancelled:
            return None
        if peer != t.prefill_peer or done.request_id != t.request_id:  # not this transfer's
            raise ProtocolError(f"PrefillDone for transfer {t.transfer_id} from the wrong "
                                f"sender {peer} (request {done.request_id!r})")
        t.done = done
        if done.error:
            self.transfers.pop(t.transfer_id)
            return t
        return self._finish_if_complete(t)

    def _finish_if_complete(self, t: Transfer) -> Transfer | None:
        if not t.complete:
            return None
        self.transfers.pop(t.transfer_id)
        self.stats.num_completed += 1
        self.stats.transfer_seconds += time.monotonic() - t.started_at
        return t

    def cancel(self, transfer_id: int) -> Transfer | None:
        """Stop accepting frames; the blocks stay owned until :meth:`on_cancel_ack`."""
        t = self.transfers.get(transfer_id)
        if t is not None and not t.cancelled:
            t.cancelled, t.cancelled_at = True, time.monotonic()
        return t

    def on_cancel_ack(self, peer: str, transfer_id: int) -> Transfer | None:
        """``peer`` sends nothing more for ``transfer_id``: its blocks may be reused. An ack
        from another peer than the transfer's is ignored (matched by sender)."""
        t = self.transfers.get(transfer_id)
        if t is None or not t.cancelled or t.prefill_peer != peer:
            return None
        return self.transfers.pop(transfer_id)

    def timed_out(self, timeout_s: float) -> list[Transfer]:
        """Transfers still running (not cancelled) that started more than ``timeout_s`` ago."""
        now = time.monotonic()
        return [t for t in self.transfers.values()
                if not t.cancelled and now - t.started_at > timeout_s]

    def cancel_unacked(self, timeout_s: float) -> list[Transfer]:
        """Cancelled transfers whose acknowledgement has not come within ``timeout_s``."""
        now = time.monotonic()
        return [t for t in self.transfers.values()
                if t.cancelled and now - (t.cancelled_at or now) > timeout_s]
