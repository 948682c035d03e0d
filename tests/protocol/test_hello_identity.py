"""Hello / HelloAck compare every field docs/architecture.md, 'Handshake' lists (protocol version,
role, instance
id and incarnation, model identity incl. the KV block size, draft method); an empty field is
not a wildcard; the HelloAck carries the acceptor's identity and the initiator checks it too
(issue 9)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from specmesh.protocol.codec import decode, encode
from specmesh.protocol.errors import ProtocolError
from specmesh.protocol.handshake import DIALS, ack_refusal, hello_refusal
from specmesh.protocol.messages import PROTOCOL_VERSION, Abort, Hello, HelloAck, ModelIdentity
from specmesh.protocol.transport import PeerUnavailable
from specmesh.protocol.zmq_transport import ZmqMailbox

MODEL = ModelIdentity(name="m", vocab_size=10, dtype="float32", num_layers=2, num_kv_heads=1,
                      head_dim=4, block_size=16, kv_cache_dtype="float32")
#: a value for each ModelIdentity field that differs from MODEL's
OTHER_VALUES = {"name": "other", "vocab_size": 11, "dtype": "bfloat16", "num_layers": 3,
                "num_kv_heads": 2, "head_dim": 8, "block_size": 32, "kv_cache_dtype": "float16",
                "lora_adapters": "caps@0123456789ab"}
MODEL_FIELDS = [f.name for f in msgspec.structs.fields(ModelIdentity)]
#: fields compared on a verifier -> drafter channel (the LoRA adapters are not: drafters
#: draft from the base; test_lora_adapters_are_compared_between_prefill_and_verifier)
DRAFTER_FIELDS = [f for f in MODEL_FIELDS if f != "lora_adapters"]


def _hello(**changes) -> Hello:
    base = {"protocol_version": PROTOCOL_VERSION, "role": "verifier",
            "instance_id": "verifier-0", "incarnation": 7, "model": MODEL,
            "draft_method": "ngram"}
    return Hello(**{**base, **changes})


def _ack(**changes) -> HelloAck:
    base = {"accepted": True, "protocol_version": PROTOCOL_VERSION, "role": "drafter",
            "instance_id": "drafter-0", "incarnation": 9, "model": MODEL,
            "draft_method": "ngram"}
    return HelloAck(**{**base, **changes})


def _refusal(hello: Hello) -> str:
    """The drafter's answer to ``hello`` on the connection of ``verifier-0``."""
    return hello_refusal(hello, "verifier-0", MODEL, role="drafter", draft_method="ngram")


def test_every_model_identity_field_is_compared():
    assert set(OTHER_VALUES) == set(MODEL_FIELDS)  # a new field needs a case here


def test_a_matching_hello_and_ack_are_accepted():
    assert _refusal(_hello()) == ""
    assert ack_refusal(_ack(), "drafter-0", role="verifier", model=MODEL,
                       draft_method="ngram") == ""


@pytest.mark.parametrize("field", DRAFTER_FIELDS)
def test_hello_with_a_different_model_field_is_refused_naming_it(field):
    hello = _hello(model=msgspec.structs.replace(MODEL, **{field: OTHER_VALUES[field]}))
    why = _refusal(hello)
    assert why and field in why, why


@pytest.mark.parametrize("field, value", [
    ("protocol_version", PROTOCOL_VERSION - 1), ("instance_id", "verifier-1"),
    ("role", "prefill"), ("role", "gateway"), ("role", "nonsense"), ("draft_method", "eagle"),
])
def test_hello_with_a_different_field_is_refused_naming_it(field, value):
    why = _refusal(_hello(**{field: value}))
    assert why and field.split("_")[0] in why.replace(" ", "_"), why


@pytest.mark.parametrize("field", [f for f in DRAFTER_FIELDS if f != "kv_cache_dtype"])
def test_an_empty_model_field_is_not_a_wildcard(field):
    empty = "" if isinstance(getattr(MODEL, field), str) else 0
    why = _refusal(_hello(model=msgspec.structs.replace(MODEL, **{field: empty})))
    assert why and field in why and "empty" in why, why


def test_lora_adapters_are_compared_between_prefill_and_verifier():
    """Prefill and verifier must serve the same LoRA adapters (an adapter's prompt KV is the
    adapter's): a verifier's Hello with another set, or none, is refused by a prefill worker
    and its HelloAck by the verifier, naming LoRA; a drafter and a gateway do not compare
    them (drafters draft from the base, the gateway runs no model)."""
    served = msgspec.structs.replace(MODEL, lora_adapters="caps@0123456789ab,json@ba9876543210")
    other = msgspec.structs.replace(served, lora_adapters="caps@0123456789ab,json@000000000000")
    for theirs, ours in ((other, served), (MODEL, served), (served, MODEL)):
        why = hello_refusal(_hello(model=theirs), "verifier-0", ours, role="prefill",
                            draft_method="ngram")
        assert "LoRA adapter mismatch" in why, why
        why = ack_refusal(_ack(role="prefill", instance_id="prefill-0", model=theirs),
                          "prefill-0", role="verifier", model=ours, draft_method="ngram")
        assert "LoRA adapter mismatch" in why, why
    assert hello_refusal(_hello(model=served), "verifier-0", served, role="prefill",
                         draft_method="ngram") == ""
    assert _refusal(_hello(model=served)) == ""  # the drafter serves none
    assert ack_refusal(_ack(model=MODEL), "drafter-0", role="verifier", model=served,
                       draft_method="ngram") == ""
    gateway = _hello(role="gateway", instance_id="gateway-0", model=MODEL)
    assert hello_refusal(gateway, "gateway-0", served, role="verifier",
                         draft_method="ngram") == ""


def test_the_kv_cache_dtype_is_compared_and_empty_is_not_a_wildcard():
    unset = msgspec.structs.replace(MODEL, kv_cache_dtype="")
    assert "kv_cache_dtype" in _refusal(_hello(model=unset))
    other = msgspec.structs.replace(MODEL, kv_cache_dtype="bfloat16")
    assert "kv_cache_dtype" in _refusal(_hello(model=other))


@pytest.mark.parametrize("changes, word", [
    ({"model": None}, "model"), ({"draft_method": ""}, "draft"), ({"incarnation": 0}, "incarnation"),
    ({"role": ""}, "role"),
])
def test_empty_hello_fields_are_refused(changes, word):
    why = _refusal(_hello(**changes))
    assert why and word in why, why


@pytest.mark.parametrize("changes, word", [
    ({"instance_id": "drafter-1"}, "instance"), ({"role": "prefill"}, "role"),
    ({"role": "gateway"}, "role"), ({"incarnation": 0}, "incarnation"),
    ({"protocol_version": PROTOCOL_VERSION + 1}, "protocol"), ({"model": None}, "model"),
    ({"model": msgspec.structs.replace(MODEL, block_size=8)}, "block_size"),
    ({"model": msgspec.structs.replace(MODEL, dtype="")}, "dtype"),
    ({"draft_method": "eagle"}, "draft"), ({"draft_method": ""}, "draft"),
])
def test_the_initiator_refuses_an_ack_whose_identity_mismatches(changes, word):
    why = ack_refusal(_ack(**changes), "drafter-0", role="verifier", model=MODEL,
                      draft_method="ngram", peer_role="drafter")
    assert why and word in why, why


def test_a_gateway_channel_does_not_compare_the_dtype():
    """The gateway runs no model and holds no KV: a verifier accepts its Hello in another dtype
    and the gateway its HelloAck; every other field still counts, and the dtype must still be
    set (empty is not a wildcard), and between model roles it is compared."""
    bf16 = msgspec.structs.replace(MODEL, dtype="bfloat16")
    gateway_hello = _hello(role="gateway", instance_id="gateway-0", model=bf16)
    assert hello_refusal(gateway_hello, "gateway-0", MODEL, role="verifier",
                         draft_method="ngram") == ""
    assert ack_refusal(_ack(role="verifier", instance_id="verifier-0"), "verifier-0",
                       role="gateway", model=bf16, draft_method="ngram",
                       peer_role="verifier") == ""
    other = msgspec.structs.replace(bf16, block_size=32)
    assert "block_size" in hello_refusal(_hello(role="gateway", instance_id="gateway-0",
                                                model=other), "gateway-0", MODEL,
                                         role="verifier", draft_method="ngram")
    empty = msgspec.structs.replace(MODEL, dtype="")
    assert "empty" in hello_refusal(_hello(role="gateway", instance_id="gateway-0",
                                           model=empty), "gateway-0", MODEL, role="verifier",
                                    draft_method="ngram")
    assert "dtype" in _refusal(_hello(model=bf16))  # verifier -> drafter: compared


def test_who_may_dial_whom():
    assert DIALS == {"gateway": {"verifier"}, "verifier": {"prefill", "drafter"}}
    assert _refusal(_hello(role="drafter"))  # a drafter never dials a drafter
    assert hello_refusal(_hello(role="gateway"), "verifier-0", MODEL, role="verifier",
                         draft_method="ngram") == ""


def test_hello_ack_carries_the_acceptors_identity_on_the_wire():
    ack = _ack()
    assert decode(encode(ack)) == ack
    assert {"protocol_version", "model", "draft_method"} <= {
        f.name for f in msgspec.structs.fields(HelloAck)}


# -- over ZMQ -----------------------------------------------------------------------------


def _pump(mailboxes, cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        for mb in mailboxes:
            mb.recv(0.01)


def test_zmq_block_size_mismatch_is_refused_by_the_acceptor_with_a_clear_error():
    drafter = ZmqMailbox("drafter-0", "drafter", model=MODEL, draft_method="ngram")
    verifier = ZmqMailbox("verifier-0", "verifier", draft_method="ngram",
                          model=msgspec.structs.replace(MODEL, block_size=8))
    errors: list = []
    try:
        verifier.connect("drafter-0", drafter.endpoint)

        def seen() -> bool:
            for mb in (drafter, verifier):
                env = mb.recv(0.01)
                if env is not None and env.is_error:
                    errors.append((mb.name, str(env.msg)))
            return len(errors) >= 2

        _pump([], seen)
        assert all("block_size" in e for _, e in errors), errors
        assert {n for n, _ in errors} == {"drafter-0", "verifier-0"}
        assert not verifier.ready("drafter-0") and "verifier-0" not in drafter.accepted
        with pytest.raises(PeerUnavailable, match="block_size"):
            verifier.send("drafter-0", Abort(request_id="x"))
    finally:
        verifier.close()
        drafter.close()


@pytest.mark.parametrize("changes, word", [
    ({"instance_id": "drafter-9"}, "instance"),
    ({"model": msgspec.structs.replace(MODEL, name="another")}, "name"),
    ({"draft_method": "eagle"}, "draft"), ({"role": "gateway"}, "role"),
    ({"role": "prefill"}, "role"),
])
def test_zmq_initiator_refuses_a_hello_ack_with_the_wrong_identity(changes, word):
    """A fake acceptor (raw ROUTER) answers Hello with a HelloAck that accepts but names
    another identity: the initiator counts a protocol error, never becomes ready, sends
    fail, and whatever the fake sends afterwards is refused too."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    verifier = ZmqMailbox("verifier-0", "verifier", model=MODEL, draft_method="ngram")
    try:
        verifier.connect("drafter-0", router.getsockopt_string(zmq.LAST_ENDPOINT), "drafter")
        assert router.poll(5000)
        ident, *frames = router.recv_multipart()
        assert ident == b"verifier-0" and isinstance(decode(frames), Hello)
        router.send_multipart([ident, *encode(_ack(**changes))])
        env = None
        deadline = time.monotonic() + 5
        while env is None and time.monotonic() < deadline:
            env = verifier.recv(0.02)
        assert env is not None and env.is_error and word in str(env.msg), env
        assert verifier.num_protocol_errors == 1 and not verifier.ready("drafter-0")
        with pytest.raises(PeerUnavailable):
            verifier.send("drafter-0", Abort(request_id="x"))
        router.send_multipart([ident, *encode(Abort(request_id="r"))])
        env = None
        deadline = time.monotonic() + 5
        while env is None and time.monotonic() < deadline:
            env = verifier.recv(0.02)
        assert env is not None and isinstance(env.msg, ProtocolError), env
        assert verifier.num_protocol_errors == 2
    finally:
        verifier.close()
        router.close(0)
