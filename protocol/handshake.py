"""The Hello handshake's rules, apart from any transport: when a peer is refused, and what a
mailbox remembers of a peer (docs/architecture.md, 'Handshake').

Both sides compare every field docs/architecture.md, 'Handshake' lists: protocol version, role (who
may open a
channel to whom, :data:`DIALS`), instance id (the one the connection carries / the one dialled),
incarnation, model identity (every :class:`ModelIdentity` field, the KV block size included;
not the dtype on a gateway's channels, :data:`UNCOMPARED`) and draft method. An empty field is
not a wildcard: a Hello or HelloAck that leaves one empty is refused. The acceptor checks the
Hello (:func:`hello_refusal`), the initiator checks the HelloAck, which carries the acceptor's
identity (:func:`ack_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.protocol.enums import Role
from specmesh.protocol.messages import PROTOCOL_VERSION, Hello, HelloAck, ModelIdentity

#: ModelIdentity fields two peers must agree on: all of them (none may be empty but those of
#: :data:`MAY_BE_EMPTY`).
IDENTITY_FIELDS = ModelIdentity.__struct_fields__
#: fields whose empty value means something (no LoRA adapters), so is not a wildcard either
MAY_BE_EMPTY = frozenset({"lora_adapters"})

#: role -> the roles it opens channels to (docs/architecture.md, 'Roles': the gateway dials
#: verifiers, a
#: verifier dials prefill workers and drafters; nobody else dials anybody).
DIALS: dict[str, set[str]] = {
    Role.GATEWAY.value: {Role.VERIFIER.value},
    Role.VERIFIER.value: {Role.PREFILL.value, Role.DRAFTER.value},
}

_ROLES = frozenset(r.value for r in Role)

#: role -> ModelIdentity fields not compared on a channel it is one end of: the gateway runs no
#: model and holds no KV (it exchanges token ids), so its dtype and KV cache dtype never have to
#: match (they must still be set: an empty field is not a wildcard)
#: (nor the LoRA adapters, which only prefill and verifier serve: drafters draft from the base)
UNCOMPARED: dict[str, frozenset[str]] = {
    Role.GATEWAY.value: frozenset({"dtype", "kv_cache_dtype", "lora_adapters"}),
    Role.DRAFTER.value: frozenset({"lora_adapters"}),
}


@dataclass
class PeerInfo:
    """A peer as a mailbox knows it after its Hello / HelloAck."""

    name: str
    role: str
    incarnation: int
    endpoint: str = ""
    acked: bool = False  # dealer side: our Hello was accepted on the current connection
    num_connects: int = 0  # dealer side: TCP connections made (more than one = reconnects)


def identity_mismatch(ours: ModelIdentity | None, theirs: ModelIdentity | None,
                      uncompared: frozenset[str] = frozenset()) -> str:
    """Empty when ``theirs`` is the model ``ours`` is; else why not, naming the field: a
    missing identity (when we have one), an empty (zero) field, or a field that differs (those
    in ``uncompared`` may differ). Two mailboxes that both carry no identity (tests of the
    transport alone) agree."""
    if theirs is None:
        return "" if ours is None else "no model identity (not a wildcard)"
    for f in IDENTITY_FIELDS:
        b = getattr(theirs, f)
        if f in MAY_BE_EMPTY:
            continue
        if not b or (isinstance(b, int) and b < 0):
            return f"model identity field {f} is empty ({b!r}): not a wildcard"
    if ours is None:
        return "a model identity where we have none"
    for f in IDENTITY_FIELDS:
        a, b = getattr(ours, f), getattr(theirs, f)
        if a != b and f not in uncompared:
            if f == "lora_adapters":
                return (f"LoRA adapter mismatch: the peer serves {b or 'none'!r}, we serve "
                        f"{a or 'none'!r} (give prefill and verifier the same --lora-modules)")
            return f"model mismatch: {f} {b!r} != ours {a!r}"
    return ""


def _common_refusal(version: int, role: str, incarnation: int, model: ModelIdentity | None,
                    draft_method: str, *, our_model: ModelIdentity | None,
                    our_draft_method: str, our_role: str | None = None) -> str:
    if version != PROTOCOL_VERSION:
        return f"protocol version {version} != ours {PROTOCOL_VERSION}"
    if role not in _ROLES:
        return f"unknown role {role!r}"
    if type(incarnation) is not int or incarnation <= 0:
        return f"incarnation {incarnation!r} is empty (must be > 0)"
    uncompared = UNCOMPARED.get(role, frozenset()) | UNCOMPARED.get(our_role or "", frozenset())
    why = identity_mismatch(our_model, model, uncompared)
    if why:
        return why
    if draft_method != our_draft_method:
        return (f"draft method {draft_method!r} != ours {our_draft_method!r}"
                + (" (empty is not a wildcard)" if not draft_method else ""))
    return ""


def hello_refusal(hello: Hello, peer: str, model: ModelIdentity | None, *,
                  role: str | None = None, draft_method: str = "") -> str:
    """Why ``hello``, received on the connection of ``peer`` by an acceptor of ``role`` with
    ``model`` and ``draft_method``, is refused ("" to accept it): a protocol version other than
    ours, an instance id that is not the connection's, an unknown role or one that does not
    open channels to ``role`` (:data:`DIALS`; not checked when ``role`` is None), an empty
    incarnation, a model identity that is missing, has an empty field or differs in one it
    compares (:data:`UNCOMPARED`), or another draft method."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return f"protocol version {hello.protocol_version} != ours {PROTOCOL_VERSION}"
    if not hello.instance_id or hello.instance_id != peer:
        return f"instance id {hello.instance_id!r} does not match the connection {peer!r}"
    why = _common_refusal(hello.protocol_version, hello.role, hello.incarnation, hello.model,
                          hello.draft_method, our_model=model, our_draft_method=draft_method,
                          our_role=role)
    if why:
        return why
    if role is not None and role not in DIALS.get(hello.role, ()):
        return f"role {hello.role!r} does not open channels to a {role}"
    return ""


def ack_refusal(ack: HelloAck, peer: str, *, role: str, model: ModelIdentity | None,
                draft_method: str, peer_role: str = "") -> str:
    """Why the initiator (of ``role``, ``model``, ``draft_method``), which dialled ``peer``
    (as a ``peer_role``, when the roster said; "" when unknown), refuses an accepting ``ack``
    ("" to accept it): the acceptor names another instance, a role ``role`` does not dial
    (:data:`DIALS`) or not ``peer_role``, or any field :func:`hello_refusal` checks differs or
    is empty."""
    if ack.instance_id != peer:
        return f"instance id {ack.instance_id!r} answered for {peer!r}"
    why = _common_refusal(ack.protocol_version, ack.role, ack.incarnation, ack.model,
                          ack.draft_method, our_model=model, our_draft_method=draft_method,
                          our_role=role)
    if why:
        return why
    if ack.role not in DIALS.get(role, ()):
        return f"role {ack.role!r} is not one a {role} dials"
    if peer_role and ack.role != peer_role:
        return f"role {ack.role!r} answered for the {peer_role} {peer!r}"
    return ""
