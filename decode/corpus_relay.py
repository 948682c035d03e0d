"""The verifier's part in the drafters' corpora (docs/drafters.md, 'Corpora'): the gateway dials
only verifiers and only verifiers dial drafters (protocol/handshake.py, DIALS), so a
DrafterCorpus from a gateway is relayed here to every drafter, and each drafter's
DrafterCorpusResult goes back to the gateway that sent the operation.

The relay keeps every corpus loaded through it (its chunks, as they came) and sends them to a
drafter that joins later or restarts (a new incarnation says Hello: ``drafter_joined``), so a
drafter's corpora never depend on when it started. A restarted verifier has none: the gateway
sends its corpora again when the new incarnation acknowledges its Hello.

After relaying an operation (a load's last chunk) it tells the gateway which drafters got it
(DrafterCorpusRelayed), so the gateway knows whose answers to wait for. A load whose chunks
come out of order is refused there (DrafterCorpusRelayed with an error) and not relayed
further; the drafters then answer its later chunks with an error of their own.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from specmesh.protocol.enums import CorpusOp
from specmesh.protocol.messages import DrafterCorpus, DrafterCorpusRelayed, DrafterCorpusResult

log = logging.getLogger(__name__)

#: most operations whose gateway is remembered, to route the drafters' answers back (the
#: oldest are forgotten: a late answer to one of them is dropped)
MAX_ORIGINS = 4096


@dataclass
class _Load:
    """One corpus load as relayed: its chunks so far, who sent it, which drafters got all."""

    op_id: int
    origin: str
    num_chunks: int
    chunks: list[DrafterCorpus] = field(default_factory=list)
    sent_to: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.chunks) == self.num_chunks


class CorpusRelay:
    """Relays corpus operations between gateways and drafters. ``send(peer, msg) -> bool`` is
    the verifier's send (False: not sent); ``drafters()`` the drafters to relay to now.
    Loop thread only."""

    def __init__(self, send: Callable[[str, object], bool],
                 drafters: Callable[[], list[str]]) -> None:
        self._send = send
        self._drafters = drafters
        #: name -> the newest complete load of that name (re-sent to drafters that join)
        self.corpora: dict[str, _Load] = {}
        #: name -> a load whose chunks are still coming
        self._loading: dict[str, _Load] = {}
        self._origins: OrderedDict[int, str] = OrderedDict()  # op id -> gateway
        self.num_relayed = 0  # operations relayed (a load counted once)
        self.num_results = 0  # drafter answers forwarded to a gateway

    def on_operation(self, peer: str, msg: DrafterCorpus) -> None:
        """Relay operation ``msg`` from gateway ``peer`` to every drafter (and keep a load)."""
        self._remember(msg.op_id, peer)
        if msg.op == CorpusOp.LOAD:
            self._on_load_chunk(peer, msg)
            return
        if msg.op == CorpusOp.DROP:
            for table in (self.corpora, self._loading):
                held = table.get(msg.name)
                if held is not None and held.op_id < msg.op_id:
                    del table[msg.name]
        sent = self._relay(msg, self._drafters())
        self.num_relayed += 1
        self._report(peer, msg, sorted(sent))

    def on_result(self, peer: str, msg: DrafterCorpusResult) -> bool:
        """Forward drafter ``peer``'s answer to the gateway of its operation; False when that
        gateway is not known (an answer to a forgotten operation: dropped)."""
        origin = self._origins.get(msg.op_id)
        held = self.corpora.get(msg.name)
        if origin is None and held is not None and held.op_id == msg.op_id:
            origin = held.origin  # a corpus re-sent long after it was loaded
        if origin is None:
            return False
        self.num_results += 1
        self._send(origin, msg)
        return True

    def drafter_joined(self, drafter: str) -> None:
        """Send ``drafter`` (new, or a new incarnation) every corpus held, and the chunks so
        far of loads still coming (their later chunks follow as they arrive)."""
        for load in [*self.corpora.values(), *self._loading.values()]:
            if all(self._send(drafter, chunk) for chunk in load.chunks):
                load.sent_to.add(drafter)
        if self.corpora:
            log.info("corpora %s sent to drafter %s", sorted(self.corpora), drafter)

    # -- internals --------------------------------------------------------------------------

    def _on_load_chunk(self, peer: str, msg: DrafterCorpus) -> None:
        name = msg.name
        load = self._loading.get(name)
        if msg.chunk_index == 0:
            load = self._loading[name] = _Load(msg.op_id, peer, msg.num_chunks)
            load.sent_to = set(self._drafters())
        elif load is None or load.op_id != msg.op_id or load.num_chunks != msg.num_chunks \
                or msg.chunk_index != len(load.chunks):
            self._loading.pop(name, None)
            want = "chunk 0" if load is None or load.op_id != msg.op_id \
                else f"chunk {len(load.chunks)} of {load.num_chunks}"
            self._report(peer, msg, [], f"chunk {msg.chunk_index} of {msg.num_chunks} of load "
                                        f"{msg.op_id} came where {want} was due: not relayed")
            return
        load.chunks.append(msg)
        load.sent_to &= self._relay(msg, sorted(load.sent_to))
        if not load.complete:
            return
        del self._loading[name]
        held = self.corpora.get(name)
        if held is None or held.op_id < load.op_id:
            self.corpora[name] = load
        self.num_relayed += 1
        self._report(peer, msg, sorted(load.sent_to))

    def _relay(self, msg: DrafterCorpus, drafters: list[str]) -> set[str]:
        """Send ``msg`` to ``drafters``; the ones it left for."""
        return {d for d in drafters if self._send(d, msg)}

    def _report(self, gateway: str, msg: DrafterCorpus, drafters: list[str],
                error: str = "") -> None:
        self._send(gateway, DrafterCorpusRelayed(op=msg.op, op_id=msg.op_id, name=msg.name,
                                                 drafters=drafters, error=error))

    def _remember(self, op_id: int, gateway: str) -> None:
        self._origins[op_id] = gateway
        self._origins.move_to_end(op_id)
        if len(self._origins) > MAX_ORIGINS:
            self._origins.popitem(last=False)
