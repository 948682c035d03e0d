"""Which target hidden states a draft seed state carries (docs/architecture.md, 'Messages', seed
state).

A seed state kind is a string a draft method declares and the prefill worker and verifier
honour: ``""`` (none), ``"hidden"`` (the final-norm hidden state, the LM head's input: EAGLE,
arXiv 2401.15077) or ``"hidden:L1,L2,..."`` (the outputs of decoder layers L1, L2, ... side by
side, 0-based: EAGLE-3's fusion of low, middle and high features, arXiv 2503.01840). A row of
kind ``"hidden:2,15,26"`` of a model with hidden size d is ``3 * d`` wide.
"""

from __future__ import annotations

HIDDEN = "hidden"
#: the seed-state kinds a draft method may declare (its instances may narrow ``"hidden"`` to
#: ``"hidden:L1,L2,..."``); defined here, once, for the drafter, the verifier and prefill
SEED_STATE_KINDS = ("", HIDDEN)


def is_hidden_seed(kind: str) -> bool:
    """Whether ``kind`` asks for target hidden states (either form)."""
    return kind == HIDDEN or kind.startswith(HIDDEN + ":")


def seed_state_layers(kind: str) -> tuple[int, ...] | None:
    """The decoder layers of a ``"hidden:..."`` kind; None for ``"hidden"`` (final-norm state).

    Raises:
        ValueError: not a hidden kind, or a malformed / empty / repeated / negative layer list.
    """
    if kind == HIDDEN:
        return None
    prefix = HIDDEN + ":"
    if not kind.startswith(prefix):
        raise ValueError(f"seed state {kind!r} is not {HIDDEN!r} or '{prefix}L1,L2,...'")
    try:
        layers = tuple(int(x) for x in kind[len(prefix):].split(","))
    except ValueError:
        raise ValueError(f"seed state {kind!r}: layers must be integers") from None
    if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError(f"seed state {kind!r}: layers must be distinct and >= 0")
    return layers


def hidden_seed_kind(layers: tuple[int, ...] | list[int] | None) -> str:
    """The kind of a feature head reading ``layers`` (None or empty: the final-norm state)."""
    return HIDDEN if not layers else f"{HIDDEN}:" + ",".join(str(int(x)) for x in layers)


def check_seed_state(kind: str) -> str:
    """``kind`` if it is a seed state the workers can ship: ``""``, ``"hidden"`` or
    ``"hidden:L1,L2,..."``.

    Raises:
        ValueError: any other value, or a malformed layer list.
    """
    if kind in SEED_STATE_KINDS:
        return kind
    try:
        seed_state_layers(kind)
    except ValueError as err:
        raise ValueError(f"seed state must be one of {SEED_STATE_KINDS} or "
                         f"'{HIDDEN}:L1,L2,...', got {kind!r} ({err})") from None
    return kind


def seed_state_width(kind: str, hidden_size: int) -> int:
    """Width of one seed-state row of ``kind`` (0 for a kind without hidden states).

    Raises:
        ValueError: a malformed hidden kind.
    """
    if not is_hidden_seed(kind):
        return 0
    layers = seed_state_layers(kind)
    return hidden_size * (1 if layers is None else len(layers))


def check_hidden_layers(layers: tuple[int, ...] | None, num_layers: int) -> None:
    """Raises ValueError unless ``layers`` are distinct decoder-layer indices of a model with
    ``num_layers`` layers (None: the final-norm state, always fine)."""
    if layers is None:
        return
    if not layers or len(set(layers)) != len(layers) or any(
            not 0 <= i < num_layers for i in layers):
        raise ValueError(f"hidden layers {list(layers)} must be distinct indices in "
                         f"[0, {num_layers})")
