"""Issue 9: 10,000 fuzzed messages per role socket, generated with ``hypothesis``, over real
ZMQ sockets against prefill, verifier and drafter workers running their loops in threads and a
gateway backend (docs/architecture.md, 'Messages': decoding trusts nothing, the role keeps running).

Sockets: the verifier's (from a gateway, from a prefill peer, from a drafter peer), the prefill
worker's and the drafter's (from a verifier), the gateway's (TokenStreams from a verifier).
Each fuzz peer completes the Hello handshake, then sends bursts mixing four kinds of message:

- ``bytes``: random frames (some from a raw socket that never said Hello);
- ``wrong_type``: a valid header whose one field has the wrong type, is missing or is extra;
- ``out_of_range``: a field outside its range (negative positions, counts, token ids), or a
  well-formed request no role can run (empty or out-of-vocabulary prompt, ``top_p`` > 1);
- ``unknown``: a valid message for an unknown request, transfer or the finished one.

After every burst: the role handled every message without raising, its loop still runs, its
protocol-error metric (``specmesh:protocol_errors`` / ``specmesh:gateway_protocol_errors``)
rose by exactly the number of messages the codec refuses (computed here with
``protocol.codec.decode``, plus those sent before Hello), and every valid message was dropped
and counted (the role's dropped-message counters) or, for a request no role can run, answered
with a refusal. Then a real request through that role equals plain greedy decode, with drafts
accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import Counter
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq
from helpers.models import tiny_llama
from helpers.proposers import OracleProposer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from specmesh.gateway.backend import MailboxBackend
from specmesh.gateway.metrics import GatewayMetrics
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.metrics import RoleCollector
from specmesh.protocol.codec import decode, encode
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import (
    REGISTRY,
    DrafterCorpus,
    DraftSync,
    GenerateRequest,
    Hello,
    HelloAck,
    LoraAdapterOp,
    ModelIdentity,
    PrefillDone,
    PrefillRequest,
    SamplingParams,
    TokenStream,
)
from specmesh.protocol.zmq_transport import ZmqMailbox

pytestmark = pytest.mark.slow  # 10,000 messages per socket, six sockets

MESSAGES_PER_SOCKET = 10_000
BURST = 50
PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 10, 11]]
SP = SamplingParams(max_tokens=16)
BLOCK_SIZE = 4
FINISHED = "exact-0"  # the id of a request that ran and finished before the fuzz
DRAFT_METHOD = "ngram"

ALL_CLASSES = sorted((c for c in REGISTRY.values() if c not in (Hello, HelloAck)),
                     key=lambda c: c.TAG)
#: wire values no field of any message accepts
NEVER_VALID = [{"x": 1}, msgspec.msgpack.Ext(7, b"zz"), [{"a": 1}]]
#: (class, field, value) outside the field's range: the codec refuses them
OUT_OF_RANGE = [
    ("TokenStream", "token_ids", [1, -1]), ("TokenStream", "offset", -1),
    ("TokenStream", "num_prompt_tokens", -3), ("TokenStream", "num_accepted_tokens", -1),
    ("DraftTailStream", "start_pos", -1), ("DraftTailStream", "base_committed_len", -2),
    ("DraftTailStream", "draft_token_ids", [3, -2]), ("DraftTailStream", "parents", [-1, 0]),
    ("DraftTailStream", "base_committed_len", 99), ("Abort", "num_output_tokens", -1),
]


# -- what the fuzz peers send ------------------------------------------------------------
#
# Hypothesis draws one byte string per burst (BYTES_PER_MESSAGE bytes per message); each
# message is built from its slice by the structure-aware builders below, which read their
# decisions (kind, class, field, value, request id) off those bytes. Drawing the structure
# with one strategy call per decision costs about 2-4 ms per message on a 2-core machine
# (hypothesis' per-choice overhead), 30-60 s per socket; one byte string per burst keeps the
# whole module under a minute and a half while hypothesis still supplies (and derandomizes)
# every input.

BYTES_PER_MESSAGE = 64
#: integers at the edges of what a field may carry
EDGE_INTS = [0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**32, 2**62, 2**63 - 1, -(2**63), 2**64 - 1]
#: request ids: the finished request's, ones no role knows, odd strings
KNOWN_IDS = [FINISHED, "req-0", "never-sent", "", "é€\u0000", "x" * 300]


class Fuzz:
    """Decisions read off ``data`` (bytes hypothesis drew), wrapping around at its end."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data or b"\x00", 0

    def byte(self) -> int:
        b = self.data[self.pos % len(self.data)]
        self.pos += 1
        return b

    def below(self, n: int) -> int:
        """An int in ``[0, n)`` (from up to 8 bytes)."""
        v = 0
        for _ in range(min(8, max(1, (n - 1).bit_length() // 8 + 1))):
            v = (v << 8) | self.byte()
        return v % n

    def choice(self, seq):
        return seq[self.below(len(seq))]

    def take(self, n: int) -> bytes:
        return bytes(self.byte() for _ in range(n))

    def request_id(self) -> str:
        if self.byte() % 2:
            return self.choice(KNOWN_IDS)
        return self.take(self.below(12)).decode("utf-8", errors="replace")


def _valid(cls: type, rid: str, transfer_id: int):
    """``cls.example()`` naming request ``rid`` (and transfer ``transfer_id``)."""
    names = set(cls.__struct_fields__)
    changes = {}
    if "request_id" in names:
        changes["request_id"] = rid
    if "transfer_id" in names:
        changes["transfer_id"] = transfer_id
    return msgspec.structs.replace(cls.example(), **changes)


def _with_header(frames: list, body: dict) -> list:
    return [msgspec.msgpack.encode(body)] + list(frames[1:])


def random_bytes(f: Fuzz) -> tuple[list, str]:
    return [f.take(f.below(49)) for _ in range(1 + f.below(3))], "bytes"


def wrong_type(f: Fuzz) -> tuple[list, str]:
    """A valid header with one field of the wrong type, a required one missing, one extra, or
    a bad tag."""
    cls = f.choice(ALL_CLASSES)
    frames = encode(_valid(cls, f.request_id(), 5))
    body = msgspec.msgpack.decode(frames[0])
    name = f.choice(sorted(body))
    how = f.choice(["replace", "replace", "missing", "extra", "tag"])
    if how == "replace":
        body[name] = f.choice(NEVER_VALID + [1.5 if isinstance(body[name], str) else "s"])
    elif how == "missing":  # a field with a default may be left out: drop a required one
        required = [x.name for x in msgspec.structs.fields(cls) if x.required]
        del body[f.choice(required) if required else "tag"]
    elif how == "extra":
        body["no_such_field"] = f.choice(EDGE_INTS)
    else:
        body["tag"] = f.choice(["7", 1.5, None, 999, -1, [body["tag"]]])
    return _with_header(frames, body), "wrong_type"


def out_of_range(f: Fuzz, semantic: type | None) -> tuple[list, str]:
    """A field outside its range (the codec refuses it), or (``semantic``: a class whose
    well-formed instances the role refuses with an answer) a request no role can run."""
    if semantic is not None and f.byte() % 2:
        return encode(unrunnable(f, semantic)), "unrunnable"
    cls_name, name, value = f.choice(OUT_OF_RANGE)
    cls = next(c for c in ALL_CLASSES if c.__name__ == cls_name)
    frames = encode(_valid(cls, f.request_id(), 5))
    body = msgspec.msgpack.decode(frames[0])
    body[name] = value
    return _with_header(frames, body), "out_of_range"


def unrunnable(f: Fuzz, cls: type):
    """A GenerateRequest / PrefillRequest that decodes but can never run: an empty or
    out-of-vocabulary prompt, a negative token id, ``top_p`` > 1, a negative temperature,
    ``max_tokens`` < 1 (GenerateRequest)."""
    prompt, sampling = [1, 2, 3], SamplingParams(max_tokens=4)
    what = f.choice(["empty", "oov", "negative", "top_p", "temperature", "max_tokens"])
    if what == "empty" or (what == "max_tokens" and cls is not GenerateRequest):
        prompt = []
    elif what == "oov":
        prompt = [1, f.choice([64, 65, 2**31 - 1, 2**63 - 1, 64 + f.below(2**20)])]
    elif what == "negative":
        prompt = [f.choice([-1, -(2**63), -(1 + f.below(2**20))]), 2]
    elif what == "top_p":
        sampling = SamplingParams(temperature=0.7, top_p=f.choice([1.0001, 2.0, 1e300,
                                                                   float("inf")]))
    elif what == "temperature":
        sampling = SamplingParams(temperature=f.choice([-1e-3, -1.0, float("-inf"),
                                                        float("nan")]))
    else:
        sampling = SamplingParams(max_tokens=f.choice([0, -1, -(2**31), -(2**63)]))
    rid = "fuzz-" + f.request_id()
    if cls is GenerateRequest:
        return GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
    # transfer ids no fuzzed PrefillCancel names (a cancel drops a queued request: no answer)
    return PrefillRequest(request_id=rid, transfer_id=3 * 10**12 + f.below(10**6),
                          prompt_token_ids=prompt, sampling=sampling, block_table=[1])


def unknown(f: Fuzz, classes: list) -> tuple[list, str]:
    """A valid message for an unknown request or transfer, or for the finished one."""
    msg = _valid(f.choice(classes), f.request_id(), f.choice([0, 1, 2, 5, 2**62, 2**63 - 1]))
    return encode(msg), "unknown"


def message(data: bytes, valid_classes: list, semantic: type | None = None):
    """One fuzzed message built from ``data``: (frames, kind, rogue_pick)."""
    f = Fuzz(data)
    kind = f.byte() % 4
    rogue_pick = f.byte() % 20
    if kind == 0:
        frames, what = random_bytes(f)
    elif kind == 1:
        frames, what = wrong_type(f)
    elif kind == 2:
        frames, what = out_of_range(f, semantic)
    else:
        frames, what = unknown(f, valid_classes)
    return frames, what, rogue_pick


def _invalid(frames) -> bool:
    try:
        decode(frames)
    except ProtocolError:
        return True
    return False


# -- the cluster over ZMQ ----------------------------------------------------------------


class FuzzCluster:
    """Prefill, verifier and drafter workers on real ZMQ mailboxes, each looping in its own
    thread, plus a gateway backend; every ``handle`` is wrapped to count what it was given
    per peer and to record anything it raised."""

    def __init__(self, model, config, want) -> None:
        self.c = InProcessCluster(model, config, num_speculative_tokens=3, num_kv_blocks=64,
                                  block_size=BLOCK_SIZE, proposer=OracleProposer(PROMPTS, want),
                                  adaptive_drafts=False)
        # the loops run in threads here: let a step wait (a fraction of one step, as served)
        # for the tail in flight, so the exact requests see drafts on a loaded machine too
        v = self.c.verifier
        v.config = v.scheduler.config = dataclasses.replace(v.config, tail_wait_fraction=1.0)
        self.identity = ModelIdentity(name="tiny", vocab_size=config.vocab_size,
                                      dtype="float64", num_layers=config.num_layers,
                                      num_kv_heads=config.num_kv_heads,
                                      head_dim=config.head_dim, block_size=BLOCK_SIZE,
                                      kv_cache_dtype="float32")
        self.handled: Counter = Counter()  # (role, peer) -> envelopes handled
        self.raised: list = []  # (role, exception) out of a handle or a step
        self.workers = {"prefill": self.c.prefill, "verifier": self.c.verifier,
                        "drafter": self.c.drafter}
        names = {"prefill": "prefill-0", "verifier": "verifier-0", "drafter": "drafter-0"}
        for role, w in self.workers.items():
            w.mailbox = self.mailbox(names[role], role)
            w.handle = self._counting(role, w.handle)
        v = self.c.verifier.mailbox
        v.connect("prefill-0", self.c.prefill.mailbox.endpoint, "prefill")
        v.connect("drafter-0", self.c.drafter.mailbox.endpoint, "drafter")
        gw = self.mailbox("gateway-0", "gateway")
        gw.connect("verifier-0", v.endpoint, "verifier")
        self.backend = MailboxBackend(gw, lambda: "verifier-0", recv_timeout_s=0.05)
        self.backend._handle = self._counting("gateway", self.backend._handle, peer_arg=True)
        self.gateway_metrics = GatewayMetrics(CollectorRegistry(), backend=self.backend)
        self._stop = threading.Event()
        self.threads = {role: threading.Thread(
            target=w.run, args=(self._stop, 0.05, lambda e, r=role: self.raised.append((r, e))),
            daemon=True, name=f"fuzz-{role}") for role, w in self.workers.items()}
        for t in self.threads.values():
            t.start()
        self.registries = {}
        for role, w in self.workers.items():
            reg = CollectorRegistry()
            reg.register(RoleCollector(SimpleNamespace(role=role, instance_id=names[role],
                                                       worker=w)))
            self.registries[role] = reg

    def mailbox(self, name: str, role: str) -> ZmqMailbox:
        return ZmqMailbox(name, role, model=self.identity, draft_method=DRAFT_METHOD)

    def _counting(self, role: str, handle, peer_arg: bool = False):
        def wrapped(*args):
            peer = args[0] if peer_arg else args[0].peer
            try:
                return handle(*args)
            except Exception as err:
                self.raised.append((role, err))
                raise
            finally:
                self.handled[role, peer] += 1
        return wrapped

    def num_protocol_errors(self, role: str) -> int:
        """The counter :meth:`protocol_errors` exports (read without a scrape)."""
        if role == "gateway":
            return self.backend.num_protocol_errors
        return self.workers[role].stats.num_protocol_errors

    def protocol_errors(self, role: str) -> float:
        """The role's protocol-error metric, as a scrape of its registry reads it."""
        if role == "gateway":
            return self.gateway_metrics.registry.get_sample_value(
                "specmesh:gateway_protocol_errors_total")
        return self.registries[role].get_sample_value(
            "specmesh:protocol_errors_total",
            {"role": role, "instance": self.workers[role].mailbox.name})

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads.values()) and \
            self.backend._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        for w in self.workers.values():
            w.mailbox.wake()
        for t in self.threads.values():
            t.join(5)
        self.backend.close()
        for w in self.workers.values():
            w.mailbox.close()
        self.backend.mailbox.close()


def _wait(cond, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


async def _generate(backend, rid: str, prompt: list[int]):
    out, last = [], None
    async for msg in backend.generate(GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                      sampling=SP)):
        out.extend(msg.token_ids)
        last = msg
    return out, last


#: loggers that log every protocol error with its peer (60,000 warnings, silenced here)
NOISY_LOGGERS = ("specmesh.protocol.transport", "specmesh.protocol.zmq_transport",
                 "specmesh.decode.dispatch",
                 "specmesh.prefill.worker", "specmesh.drafter.worker", "specmesh.gateway.backend",
                 "specmesh.gateway.stream_reader")


@pytest.fixture(scope="module")
def fuzz():
    loggers = [logging.getLogger(n) for n in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield from _fuzz_cluster()
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _fuzz_cluster():
    _, m, cfg = tiny_llama(seed=4, dtype=torch.float64, vocab_size=64)
    ref = InProcessCluster(m, cfg, num_speculative_tokens=0, num_kv_blocks=64,
                           block_size=BLOCK_SIZE)
    want = [r.token_ids for r in ref.generate(PROMPTS, SP)]
    fc = FuzzCluster(m, cfg, want)
    try:
        out, last = asyncio.run(_generate(fc.backend, FINISHED, PROMPTS[0]))
        assert out == want[0] and last.finish_reason == "length"
        fc.want = want
        yield fc
    finally:
        fc.close()


def _exact_request(fc: FuzzCluster, rid: str) -> None:
    """A real request through gateway, verifier, prefill and drafter equals plain greedy
    decode, with drafts accepted."""
    before = fc.c.verifier.stats.num_accepted_tokens
    out, last = asyncio.run(_generate(fc.backend, rid, PROMPTS[1]))
    assert out == fc.want[1], (out, fc.want[1])
    assert last.finish_reason == "length" and last.num_accepted_tokens > 0
    assert fc.c.verifier.stats.num_accepted_tokens > before
    assert fc.alive() and not fc.raised, fc.raised


# -- one socket ----------------------------------------------------------------------------


def _fuzz_socket(fc: FuzzCluster, role: str, peer: str, send, valid_classes: list,
                 accounted, semantic: type | None = None, answers=None) -> Counter:
    """Send MESSAGES_PER_SOCKET fuzzed messages (:func:`message`, from bytes hypothesis draws;
    ``valid_classes``: what the valid ones may be, ``semantic``: the request class refused
    with an answer) with ``send(frames, rogue)`` (which returns whether it sent them through a
    socket that never said Hello), in bursts of BURST, waiting each time until ``role`` handled
    them all. Per burst: nothing raised, the protocol-error counter rose by the messages the
    codec refuses (and all of a rogue socket's), ``accounted()`` by the other ones,
    ``answers()`` (when given) by the unrunnable requests; over the whole run, the
    protocol-error metric (a registry scrape) by all the refused ones. Returns the messages
    per kind."""
    kinds: Counter = Counter()
    metric0 = fc.protocol_errors(role)

    @settings(max_examples=MESSAGES_PER_SOCKET // BURST, derandomize=True, database=None,
              deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=BURST * BYTES_PER_MESSAGE, max_size=BURST * BYTES_PER_MESSAGE))
    def burst(data):
        errors0, accounted0 = fc.num_protocol_errors(role), accounted()
        answers0 = answers() if answers else 0
        handled0 = fc.handled[role, peer] + fc.handled[role, "rogue"]
        want_errors = want_dropped = want_answers = 0
        for i in range(BURST):
            chunk = data[i * BYTES_PER_MESSAGE:(i + 1) * BYTES_PER_MESSAGE]
            frames, kind, rogue_pick = message(chunk, valid_classes, semantic)
            # 1 in 20 random-bytes messages through a rogue socket, where there is one
            rogue = send(frames, rogue_pick == 0 and kind == "bytes")
            kinds[kind] += 1
            if rogue or _invalid(frames):
                want_errors += 1
                kinds["refused"] += 1
                assert kind not in ("unknown", "unrunnable"), (kind, frames)
            elif kind == "unrunnable":
                want_answers += 1
            else:
                want_dropped += 1
                assert kind not in ("wrong_type", "out_of_range"), (kind, frames)
        _wait(lambda: fc.handled[role, peer] + fc.handled[role, "rogue"]
              >= handled0 + BURST, f"{role} to handle a burst")
        assert not fc.raised, fc.raised
        assert fc.num_protocol_errors(role) - errors0 == want_errors
        assert accounted() - accounted0 == want_dropped
        if answers:
            _wait(lambda: answers() - answers0 >= want_answers, "refusals")
            assert answers() - answers0 == want_answers

    burst()
    assert fc.protocol_errors(role) - metric0 == kinds["refused"]
    assert sum(kinds.values()) - kinds["refused"] >= MESSAGES_PER_SOCKET, kinds
    assert all(kinds[k] > MESSAGES_PER_SOCKET // 10 for k in
               ("bytes", "wrong_type", "unknown")), kinds
    assert kinds["out_of_range"] + kinds["unrunnable"] > MESSAGES_PER_SOCKET // 10, kinds
    assert fc.alive()
    return kinds


class _Rogue:
    """A raw DEALER that never says Hello."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt_string(zmq.IDENTITY, "rogue")
        self.sock.connect(endpoint)

    def send(self, frames) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(0)


class _Answers:
    """Drains a fuzz peer's mailbox in the test thread and counts refusals it received."""

    def __init__(self, mb: ZmqMailbox) -> None:
        self.mb, self.counts = mb, Counter()

    def __call__(self, what: str = "") -> int:
        env = self.mb.recv(0.0)
        while env is not None:
            m = env.msg
            if isinstance(m, TokenStream) and m.finish_reason == "invalid":
                self.counts["invalid"] += 1
            elif isinstance(m, PrefillDone) and m.error:
                self.counts["failed"] += 1
            self.counts["all"] += 1
            env = self.mb.recv(0.0)
        return self.counts[what] if what else 0


def _handshake(mb: ZmqMailbox, peer: str, endpoint: str, role: str) -> None:
    mb.connect(peer, endpoint, role)
    _wait(lambda: (mb.recv(0.01), mb.ready(peer))[1], f"{peer}'s HelloAck", 10)


def _dialled_by(dialler: ZmqMailbox, fake: ZmqMailbox, role: str) -> None:
    """``dialler`` (a worker's mailbox, owned by its loop thread) connects to ``fake``."""
    dialler.call_soon(lambda: dialler.connect(fake.name, fake.endpoint, role))

    def done() -> bool:
        fake.recv(0.01)
        return dialler.name in fake.accepted and dialler.ready(fake.name)
    _wait(done, f"{dialler.name} to connect to {fake.name}", 10)


# -- the tests -----------------------------------------------------------------------------

#: messages a role acts on whatever they name (a corpus or LoRA operation is relayed or applied
#: and answered, not dropped as one for an unknown request): never sent as the "unknown" kind
VERIFIER_TAKES_WORK = (GenerateRequest, DrafterCorpus, LoraAdapterOp)
DRAFTER_TAKES_WORK = (DraftSync, DrafterCorpus)


def test_fuzz_verifier_from_a_gateway(fuzz):
    fc = fuzz
    v = fc.c.verifier
    gw = fc.mailbox("gateway-fuzz", "gateway")
    rogue = _Rogue(v.mailbox.endpoint)
    answers = _Answers(gw)
    try:
        _handshake(gw, "verifier-0", v.mailbox.endpoint, "verifier")
        sock = gw.dealers["verifier-0"]

        def send(frames, is_rogue):
            (rogue.send if is_rogue else sock.send_multipart)(frames)
            return is_rogue

        valid = [c for c in ALL_CLASSES if c not in VERIFIER_TAKES_WORK]
        _fuzz_socket(fc, "verifier", "gateway-fuzz", send,
                     valid, lambda: v.num_dropped_messages, semantic=GenerateRequest,
                     answers=lambda: answers("invalid"))
        assert not v.requests  # nothing a fuzz message named is live
    finally:
        rogue.close()
        gw.close()
    _exact_request(fc, "after-gateway-fuzz")


@pytest.mark.parametrize("peer_role", ["prefill", "drafter"])
def test_fuzz_verifier_from_a_prefill_or_drafter_peer(fuzz, peer_role):
    fc = fuzz
    v = fc.c.verifier
    fake = fc.mailbox(f"{peer_role}-fuzz", peer_role)
    try:
        _dialled_by(v.mailbox, fake, peer_role)

        def send(frames, is_rogue):
            fake.router.send_multipart([b"verifier-0", *frames])
            return False

        valid = [c for c in ALL_CLASSES if c not in VERIFIER_TAKES_WORK]
        kinds = _fuzz_socket(fc, "verifier", fake.name, send, valid,
                             lambda: v.num_dropped_messages)
        assert kinds["unrunnable"] == 0
    finally:
        v.mailbox.call_soon(lambda: v.mailbox.disconnect(fake.name))
        fake.close()
    _exact_request(fc, f"after-{peer_role}-fuzz")


def test_fuzz_prefill_worker(fuzz):
    fc = fuzz
    p = fc.c.prefill
    fake = fc.mailbox("verifier-fuzz", "verifier")
    rogue = _Rogue(p.mailbox.endpoint)
    answers = _Answers(fake)
    try:
        _handshake(fake, "prefill-0", p.mailbox.endpoint, "prefill")
        sock = fake.dealers["prefill-0"]

        def send(frames, is_rogue):
            (rogue.send if is_rogue else sock.send_multipart)(frames)
            return is_rogue

        valid = [c for c in ALL_CLASSES if c not in (PrefillRequest, LoraAdapterOp)]
        # PrefillCancel is acknowledged whatever it names (nothing of it can follow the ack)
        _fuzz_socket(fc, "prefill", "verifier-fuzz", send,
                     valid, lambda: p.stats.num_dropped_messages + p.stats.num_cancelled,
                     semantic=PrefillRequest, answers=lambda: answers("failed"))
        assert not p.queue
    finally:
        rogue.close()
        fake.close()
    _exact_request(fc, "after-prefill-fuzz")


def test_fuzz_drafter_worker(fuzz):
    fc = fuzz
    d = fc.c.drafter
    fake = fc.mailbox("verifier-fuzz2", "verifier")
    rogue = _Rogue(d.mailbox.endpoint)
    answers = _Answers(fake)
    try:
        _handshake(fake, "drafter-0", d.mailbox.endpoint, "drafter")
        sock = fake.dealers["drafter-0"]

        def send(frames, is_rogue):
            (rogue.send if is_rogue else sock.send_multipart)(frames)
            return is_rogue

        valid = [c for c in ALL_CLASSES if c not in DRAFTER_TAKES_WORK]
        _fuzz_socket(fc, "drafter", "verifier-fuzz2", send, valid,
                     lambda: d.stats.num_dropped_messages)
        answers()
        assert not any(s.verifier == "verifier-fuzz2" for s in list(d.requests.values()))
    finally:
        rogue.close()
        fake.close()
    _exact_request(fc, "after-drafter-fuzz")


def test_fuzz_gateway_from_a_verifier(fuzz):
    fc = fuzz
    b = fc.backend
    fake = fc.mailbox("verifier-fuzz3", "verifier")
    try:
        _dialled_by(b.mailbox, fake, "verifier")

        def send(frames, is_rogue):
            fake.router.send_multipart([b"gateway-0", *frames])
            return False

        _fuzz_socket(fc, "gateway", fake.name, send, ALL_CLASSES,
                     lambda: b.num_dropped_streams + b.num_ignored_messages)
        assert b.num_in_flight == 0
    finally:
        b.mailbox.call_soon(lambda: b.mailbox.disconnect(fake.name))
        fake.close()
    _exact_request(fc, "after-gateway-socket-fuzz")
