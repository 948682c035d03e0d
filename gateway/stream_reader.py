"""The gateway backend's reader thread (docs/architecture.md, 'Messages'): it blocks on the
mailbox and hands each TokenStream to its request's asyncio queue, after checking that its
``offset`` is the number of output tokens already delivered (a lost or repeated delta fails
the request rather than return output with a hole); a ProtocolError naming a request fails
that request only; control answers go to ``control_handlers``. Nothing a peer sends stops the
thread. A mixin of :class:`gateway.backend.MailboxBackend` (its ``mailbox``, ``_pending``,
``_stop``, ``control_handlers``, counters, ``_deliver``, ``_fail``, ``_send_abort`` and
``_check_lost``)."""

from __future__ import annotations

import logging

from specmesh.gateway.pending import Pending
from specmesh.protocol.enums import FinishReason
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import TokenStream

log = logging.getLogger(__name__)


class StreamReader:
    """The reader thread's loop and message handling (see the module docstring)."""

    def _reader(self) -> None:
        while not self._stop.is_set():
            self.num_reader_turns += 1
            try:
                env = self.mailbox.recv(self._recv_timeout())
                if env is not None:
                    self._handle(env.peer, env.msg)
                self._check_lost()
            except Exception:  # noqa: BLE001 - the reader must survive anything
                log.exception("gateway backend reader: unexpected error")
                self._stop.wait(self.recv_timeout_s)

    def _handle(self, peer: str, msg: object) -> None:
        if isinstance(msg, ProtocolError):
            self.num_protocol_errors += 1
            log.warning("protocol error from %s (request %s): %s", peer, msg.request_id, msg)
            if msg.request_id is not None and msg.request_id in self._pending:
                # A lost delta would corrupt the text: fail that request only.
                self._send_abort(msg.request_id, "protocol error")
                self._fail(msg.request_id, FinishReason.ERROR,
                           f"protocol error from {peer}: {msg}")
            return
        if isinstance(msg, TokenStream):
            pending = self._pending.get(msg.request_id)
            if pending is not None and not pending.closed:
                if msg.offset != pending.num_tokens:
                    self._stream_gap(peer, pending, msg)
                    return
                pending.num_tokens += len(msg.token_ids)
            if pending is not None and not msg.finished:
                pending.last = msg
            if not self._deliver(msg.request_id, msg, final=msg.finished):
                self.num_dropped_streams += 1
                log.debug("dropped TokenStream for unknown request %s", msg.request_id)
            return
        handler = self.control_handlers.get(type(msg))
        if handler is not None:
            handler(peer, msg)
            return
        self.num_ignored_messages += 1
        log.debug("gateway ignores %s from %s", type(msg).__name__, peer)

    def _stream_gap(self, peer: str, pending: Pending, msg: TokenStream) -> None:
        """``msg`` does not start where the delivered output ends: a delta was lost (gap) or
        repeated (overlap). Nothing of it reaches the client; the request fails and the
        verifier is told to drop it."""
        have, rid = pending.num_tokens, msg.request_id
        if msg.offset > have:
            what = (f"a gap: output tokens {have}..{msg.offset - 1} never arrived (a lost "
                    "TokenStream)")
        else:
            what = (f"an overlap: output tokens {msg.offset}..{have - 1} arrived twice")
        self.num_stream_gaps += 1
        error = (f"the token stream of request {rid} from {peer} has {what}; the request is "
                 "failed rather than return output with a hole")
        log.warning("%s", error)
        self._send_abort(rid, "token stream gap")
        self._fail(rid, FinishReason.ERROR, error)
