"""CurveZMQ on the mailboxes (protocol/curve.py) and the per-message size cap
(protocol/socket_caps.py), on 127.0.0.1: only allowed keys deliver a message, a refused peer is
counted and logged with its address, the allowed peers' traffic is unaffected."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from specmesh.protocol.codec import encode
from specmesh.protocol.curve import CurveKeys, curve_enabled, is_loopback, roster_keys
from specmesh.protocol.messages import (
    Abort, Buffer, GenerateRequest, KVFrame, ModelIdentity, SamplingParams, TokenStream,
)
from specmesh.protocol.transport import PeerUnavailable
from specmesh.protocol.socket_caps import MIN_MESSAGE_BYTES, kv_frame_bytes, max_message_bytes
from specmesh.protocol.zmq_transport import ZmqMailbox

MODEL = ModelIdentity(name="m", vocab_size=10, dtype="float32", num_layers=2, num_kv_heads=1,
                      head_dim=4, block_size=16, kv_cache_dtype="float32")


def _recv(mb, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        env = mb.recv(0.05)
        if env is not None:
            return env
    raise AssertionError("nothing received")


def _nothing(mb, seconds: float) -> list:
    """Everything ``mb`` receives within ``seconds`` (expected: nothing)."""
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        env = mb.recv(0.05)
        if env is not None:
            got.append(env)
    return got


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _curve_server(**kw) -> ZmqMailbox:
    return ZmqMailbox("verifier-0", "verifier", model=MODEL, keys=CurveKeys.generate(),
                      curve=True, **kw)


def _client(name: str, server: ZmqMailbox, role: str = "gateway",
            server_key: bytes | None = None) -> ZmqMailbox:
    mb = ZmqMailbox(name, role, model=MODEL, keys=CurveKeys.generate())
    mb.set_peer_keys({"verifier-0": server_key or server.keys.public})
    mb.connect("verifier-0", server.endpoint, "verifier")
    return mb


def test_roster_keys_pass_and_messages_flow_both_ways():
    server = _curve_server()
    gateway = ZmqMailbox("gateway-0", "gateway", model=MODEL, keys=CurveKeys.generate())
    roster = [{"instance_id": "verifier-0", **server.security_entry()},
              {"instance_id": "gateway-0", **gateway.security_entry()}]
    assert roster[0]["curve"] and not roster[1]["curve"]
    server.allow(roster_keys(roster))
    gateway.set_peer_keys({r["instance_id"]: r["curve_key"].encode() for r in roster
                           if r["curve"]})
    gateway.connect("verifier-0", server.endpoint, "verifier")
    try:
        for i in range(20):
            gateway.send("verifier-0", Abort(request_id=f"r{i}"))
        assert [_recv(server).msg.request_id for _ in range(20)] == [f"r{i}" for i in range(20)]
        server.send("gateway-0", TokenStream(request_id="r0", token_ids=[1, 2]))
        assert _recv(gateway).msg.token_ids == [1, 2]
        assert gateway.ready("verifier-0") and server.num_refused_peers == 0
    finally:
        gateway.close()
        server.close()


def test_unknown_key_cannot_deliver_a_message_and_is_counted(caplog):
    """An intruder with a key not in the roster: refused at the handshake (counted, logged
    with its address), not one of its messages (Hello, a request, an abort) reaches the
    verifier, and the roster peer's requests go on as before."""
    caplog.set_level(logging.WARNING, logger="specmesh.protocol.curve")
    server = _curve_server()
    gateway = ZmqMailbox("gateway-0", "gateway", model=MODEL, keys=CurveKeys.generate())
    server.allow(frozenset({gateway.keys.public}))
    gateway.set_peer_keys({"verifier-0": server.keys.public})
    gateway.connect("verifier-0", server.endpoint, "verifier")
    intruder = _client("gateway-0", server)  # even under the gateway's own name
    raw = zmq.Context.instance().socket(zmq.DEALER)  # plain TCP: no Curve at all
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt_string(zmq.IDENTITY, "rogue")
    raw.connect(server.endpoint)
    try:
        req = GenerateRequest(request_id="forged", prompt_token_ids=[1, 2],
                              sampling=SamplingParams(max_tokens=4))
        for i in range(3):
            intruder.send("verifier-0", req)
            intruder.send("verifier-0", Abort(request_id=f"a{i}"))
            raw.send_multipart(encode(Abort(request_id=f"raw{i}")), zmq.NOBLOCK)
            gateway.send("verifier-0", Abort(request_id=f"ok{i}"))
        got = [_recv(server).msg.request_id for _ in range(3)]
        assert got == ["ok0", "ok1", "ok2"]
        assert _nothing(server, 1.0) == []
        assert _wait(lambda: server.num_refused_peers >= 1)
        assert server.num_protocol_errors == 0 and "rogue" not in server.accepted
        assert _wait(lambda: (gateway.recv(0.05), gateway.ready("verifier-0"))[1])
        intruder.recv(0.2)
        assert not intruder.ready("verifier-0")
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert refusals and all("127.0.0.1" in m and "not in the roster" in m
                                for m in refusals)
        assert intruder.keys.public.decode() in refusals[0]
    finally:
        raw.close(0)
        intruder.close()
        gateway.close()
        server.close()


def test_a_peer_refused_before_its_key_arrives_gets_in_once_the_roster_has_it():
    """The roster reaches the roles in any order: a dialler refused at first (its key not
    yet allowed; ZMQ gives that connection up, so a send fails at once) dials again and is
    admitted once the key is, its Hello said again."""
    server = _curve_server()
    client = _client("drafter-0", server, role="gateway")
    try:
        assert _wait(lambda: (client.recv(0.05), client.num_failed_handshakes)[1] >= 1)
        assert server.num_refused_peers >= 1 and not client.ready("verifier-0")
        with pytest.raises(PeerUnavailable):
            client.send("verifier-0", Abort(request_id="early"))
        server.allow(frozenset({client.keys.public}))

        def admitted() -> bool:
            server.recv(0.02)
            client.recv(0.02)
            return client.ready("verifier-0")

        assert _wait(admitted, timeout=10)
        client.send("verifier-0", Abort(request_id="late"))
        assert _recv(server).msg.request_id == "late" and server.ready("drafter-0")
    finally:
        client.close()
        server.close()


def test_a_server_with_another_key_than_the_roster_says_is_never_ready():
    """The dialler authenticates the server too: an impostor on the peer's address (a key
    other than the roster's) never completes the handshake."""
    server = _curve_server()
    client = _client("gateway-0", server, server_key=CurveKeys.generate().public)
    server.allow(frozenset({client.keys.public}))
    try:
        client.send("verifier-0", Abort(request_id="x"))
        assert _nothing(server, 1.0) == []
        assert not client.ready("verifier-0")
    finally:
        client.close()
        server.close()


def test_a_message_part_over_the_cap_is_refused_and_later_ones_arrive():
    """KV frames travel prefill -> verifier (on the verifier's DEALER): a frame over the
    verifier's cap never arrives (ZMQ drops the connection), the channel comes back (a new
    Hello) and later messages arrive."""
    cap = 64 << 10
    verifier = ZmqMailbox("verifier-0", "verifier", model=MODEL, max_message_bytes=cap)
    prefill = ZmqMailbox("prefill-0", "prefill", model=MODEL)
    verifier.connect("prefill-0", prefill.endpoint, "prefill")
    try:
        verifier.send("prefill-0", Abort(request_id="before"))
        assert _recv(prefill).msg.request_id == "before"
        tokens = cap // (2 * 4 * 4) + 64  # [1, 2, tokens, 1, 4] float32: over the cap
        big = KVFrame(request_id="big", transfer_id=1, layer_start=0, layer_end=1,
                      chunk_index=0, token_start=0, num_tokens=tokens,
                      kv=Buffer("float32", (1, 2, tokens, 1, 4), bytes(32 * tokens)))
        prefill.send("verifier-0", big)
        seen: list = []
        deadline, next_send = time.monotonic() + 10, 0.0
        while time.monotonic() < deadline and "after" not in seen:
            env = verifier.recv(0.05)
            if env is not None:
                seen.append(getattr(env.msg, "request_id", None))
            prefill.recv(0.01)
            if time.monotonic() > next_send and prefill.ready("verifier-0"):
                next_send = time.monotonic() + 0.2
                try:
                    prefill.send("verifier-0", Abort(request_id="after"))
                except PeerUnavailable:
                    pass  # between the drop and the new Hello
        assert "after" in seen and "big" not in seen
    finally:
        verifier.close()
        prefill.close()


def test_caps_sized_from_the_frames_and_drafts():
    smol = ModelIdentity(name="s", vocab_size=49152, dtype="float32", num_layers=30,
                         num_kv_heads=3, head_dim=64, block_size=16, kv_cache_dtype="float32")
    assert kv_frame_bytes(smol, 256, 8) == 8 * 2 * 256 * 3 * 64 * 4
    assert max_message_bytes(smol, 256, 8, 8) == MIN_MESSAGE_BYTES
    big = max_message_bytes(smol, 4096, 30, 8)
    assert big == 2 * kv_frame_bytes(smol, 4096, 30) > MIN_MESSAGE_BYTES
    assert max_message_bytes(smol, 16, 1, 256) == 2 * 256 * 49152 * 4


@pytest.mark.parametrize("mode,host,want", [
    ("auto", "127.0.0.1", False), ("auto", "::1", False), ("auto", "localhost", False),
    ("auto", "10.0.0.5", True), ("auto", "0.0.0.0", True), ("curve", "127.0.0.1", True),
    ("insecure", "10.0.0.5", False)])
def test_curve_enabled(mode, host, want):
    assert curve_enabled(mode, host) is want
    assert is_loopback(host) is (host in ("127.0.0.1", "::1", "localhost"))


def test_curve_mailbox_needs_keys_and_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="key pair"):
        ZmqMailbox("v", "verifier", model=MODEL, curve=True)
    with pytest.raises(ValueError, match="transport mode"):
        curve_enabled("tls", "127.0.0.1")
