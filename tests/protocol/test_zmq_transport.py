"""ZMQ mailboxes on 127.0.0.1: Hello handshake, ordering, garbage, cross-thread send."""

import threading
import time

import zmq

from specmesh.protocol.codec import encode
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.messages import Abort, DraftClose, ModelIdentity, TokenStream
from specmesh.protocol.transport import PeerUnavailable
from specmesh.protocol.zmq_transport import ZmqMailbox

MODEL = ModelIdentity(name="m", vocab_size=10, dtype="float32", num_layers=2, num_kv_heads=1,
                      head_dim=4, block_size=16, kv_cache_dtype="float32")


def _recv_msg(mb, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        env = mb.recv(0.05)
        if env is not None:
            return env
    raise AssertionError("nothing received")


def _pair():
    server = ZmqMailbox("verifier-0", "verifier", model=MODEL)
    client = ZmqMailbox("gateway-0", "gateway", model=MODEL)
    client.connect("verifier-0", server.endpoint)
    return server, client


def test_hello_then_ordered_messages_both_ways():
    server, client = _pair()
    try:
        assert server.endpoint.startswith("tcp://127.0.0.1:")
        for i in range(50):
            client.send("verifier-0", Abort(request_id=f"r{i}"))
        got = [_recv_msg(server).msg.request_id for _ in range(50)]
        assert got == [f"r{i}" for i in range(50)]
        assert server.ready("gateway-0")
        server.send("gateway-0", TokenStream(request_id="r0", token_ids=[1, 2]))
        env = _recv_msg(client)
        assert env.peer == "verifier-0" and env.msg.token_ids == [1, 2]
        assert client.ready("verifier-0")
    finally:
        client.close()
        server.close()


def test_message_before_hello_and_garbage_are_protocol_errors():
    server = ZmqMailbox("verifier-0", "verifier", model=MODEL)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt_string(zmq.IDENTITY, "rogue")
    raw.connect(server.endpoint)
    try:
        raw.send_multipart(encode(Abort(request_id="x")))
        env = _recv_msg(server)
        assert isinstance(env.msg, ProtocolError) and "before Hello" in str(env.msg)
        raw.send_multipart([b"\xc1\xc1 not msgpack"])
        env = _recv_msg(server)
        assert isinstance(env.msg, ProtocolError)
        assert server.num_protocol_errors == 2
    finally:
        raw.close(0)
        server.close()


def test_wrong_hello_is_refused():
    server = ZmqMailbox("verifier-0", "verifier", model=MODEL)
    other = ModelIdentity(name="m", vocab_size=99, dtype="float32", num_layers=2, num_kv_heads=1,
                          head_dim=4, block_size=16, kv_cache_dtype="float32")
    client = ZmqMailbox("drafter-x", "drafter", model=other)
    client.connect("verifier-0", server.endpoint)
    try:
        env = _recv_msg(server)
        assert isinstance(env.msg, ProtocolError) and "vocab_size" in str(env.msg)
        env = _recv_msg(client)
        assert isinstance(env.msg, ProtocolError) and "refused" in str(env.msg)
        try:
            client.send("verifier-0", Abort(request_id="x"))
            raise AssertionError("send to a refusing peer must fail")
        except PeerUnavailable:
            pass
    finally:
        client.close()
        server.close()


def test_send_from_another_thread_goes_through_the_owner():
    server, client = _pair()
    try:
        client.send("verifier-0", Abort(request_id="first"))
        assert _recv_msg(server).msg.request_id == "first"
        client.recv(0.01)  # client's owner is this thread now
        t = threading.Thread(target=lambda: client.send("verifier-0", DraftClose(request_id="t")))
        t.start()
        t.join()
        # the owner thread flushes the outbox while polling
        deadline = time.monotonic() + 5
        got = None
        while time.monotonic() < deadline and got is None:
            client.recv(0.02)
            got = server.recv(0.02)
        assert got is not None and got.msg.request_id == "t"
    finally:
        client.close()
        server.close()


def test_unknown_peer_raises():
    server = ZmqMailbox("verifier-0", "verifier")
    try:
        try:
            server.send("nobody", Abort(request_id="x"))
            raise AssertionError
        except PeerUnavailable:
            pass
    finally:
        server.close()


def _rebind(port, incarnation, timeout_s=10.0):
    """A restarted verifier on the same port: ZMQ releases a closed socket's port in its I/O
    thread, a little after close(); a real restart retries the same way."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ZmqMailbox("verifier-0", "verifier", model=MODEL, port=port,
                              incarnation=incarnation)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_hello_is_repeated_after_the_peer_restarts():
    server, client = _pair()
    seen = []
    try:
        client.on_hello = lambda info, is_new: seen.append((info.incarnation, is_new))
        client.send("verifier-0", Abort(request_id="before"))
        assert _recv_msg(server).msg.request_id == "before"
        deadline = time.monotonic() + 5
        while not client.ready("verifier-0") and time.monotonic() < deadline:
            client.recv(0.02)
        first_incarnation = server.incarnation
        port = int(server.endpoint.rsplit(":", 1)[1])
        server.close()
        # a restarted peer on the same endpoint: new incarnation, knows nobody
        server = _rebind(port, first_incarnation + 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not server.ready("gateway-0"):
            client.recv(0.02)
            env = server.recv(0.02)
            assert env is None or not isinstance(env.msg, ProtocolError), env
        assert server.ready("gateway-0")  # the client said Hello again on its own
        while time.monotonic() < deadline and len(seen) < 2:
            client.recv(0.02)
        assert seen[-1] == (first_incarnation + 1, True)
        client.send("verifier-0", Abort(request_id="after"))
        assert _recv_msg(server).msg.request_id == "after"
    finally:
        client.close()
        server.close()
