"""What the configs of trained drafts (EAGLE heads, DFlash drafts, frozen-KV assistants,
Medusa heads) share: a frozen dataclass stored as its checkpoint's ``config.json``, and for a
draft that reads the target's hidden states, the seed state its rows are."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import TypeVar

from specmesh.engine.hidden_layers import hidden_seed_kind

C = TypeVar("C", bound="CheckpointConfig")


class CheckpointConfig:
    """Mixin of a (frozen) dataclass written to and read from a checkpoint's JSON."""

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (``dataclasses.asdict``)."""
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[C], d: dict) -> C:
        """The config of ``d``, keys it has no field for ignored (a newer writer's extras)."""
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in d.items() if k in known})


class HiddenRowsConfig(CheckpointConfig):
    """A :class:`CheckpointConfig` with ``hidden_size`` and ``feature_layers`` (the target
    decoder layers whose outputs a row carries side by side; empty: the final-norm state)."""

    hidden_size: int
    feature_layers: tuple[int, ...]

    @property
    def seed_state(self) -> str:
        """The seed state its rows are (engine/hidden_layers.py): ``"hidden"`` or
        ``"hidden:L1,L2,..."``."""
        return hidden_seed_kind(self.feature_layers)

    @property
    def seed_width(self) -> int:
        """Width of one row: ``hidden_size`` per feature layer."""
        return self.hidden_size * max(1, len(self.feature_layers))
