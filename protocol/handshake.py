"""The Hello handshake's rules, apart from any transport: when a peer is refused, and what a
mailbox remembers of a peer (DESIGN.md §3)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import PROTOCOL_VERSION, Hello, ModelIdentity

#: ModelIdentity fields two peers must agree on (empty / zero values are wildcards).
IDENTITY_FIELDS = ("name", "vocab_size", "dtype", "num_layers", "num_kv_heads", "head_dim")


@dataclass
class PeerInfo:
    """A peer as a mailbox knows it after its Hello / HelloAck."""

    name: str
    role: str
    incarnation: int
    endpoint: str = ""
    acked: bool = False  # dealer side: our Hello was accepted on the current connection
    num_connects: int = 0  # dealer side: TCP connections made (more than one = reconnects)


def identity_mismatch(ours: ModelIdentity | None, theirs: ModelIdentity | None) -> str:
    """Empty when compatible; else which field differs. Empty/zero fields are wildcards
    (a gateway knows the vocabulary, not the KV layout)."""
    if ours is None or theirs is None:
        return ""
    for f in IDENTITY_FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        if a and b and a != b:
            return f"model mismatch: {f} {b!r} != ours {a!r}"
    return ""


def hello_refusal(hello: Hello, peer: str, model: ModelIdentity | None) -> str:
    """Why ``hello``, received on the connection of ``peer``, is refused ("" to accept it): a
    protocol version other than ours, an instance id that is not the connection's, or a model
    that does not match ``model``."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return f"protocol version {hello.protocol_version} != {PROTOCOL_VERSION}"
    if hello.instance_id != peer:
        return f"instance id {hello.instance_id!r} does not match the connection {peer!r}"
    return identity_mismatch(model, hello.model)
