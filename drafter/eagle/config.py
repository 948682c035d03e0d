"""Shape of an EAGLE head (drafter/eagle/head.py): the target's layer shape, the draft
vocabulary, the target it was trained for, for an EAGLE-3 fused head the target layers whose
outputs it reads (its seed state, engine/hidden_layers.py) and, for a multi-layer EAGLE head,
its ``num_steps`` per-depth modules (drafter/eagle/steps.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.drafter.checkpoint_config import HiddenRowsConfig
from specmesh.engine.hidden_layers import check_hidden_layers

#: what a multi-layer head drafts past its last module (``after_last_step``): "repeat" runs the
#: last module recurrently (as a 1-module head runs its only one), "stop" ends the chain / tree
#: at ``num_steps`` drafts
AFTER_LAST_STEP = ("repeat", "stop")


@dataclass(frozen=True)
class EagleHeadConfig(HiddenRowsConfig):
    """Shape of a head. ``hidden_size``, heads and ``vocab_size`` follow the target;
    ``draft_vocab_size`` rows of the target's LM head are kept (0: the whole vocabulary).
    ``target`` names the model the head was trained for (see drafter/eagle/checkpoint.py).
    ``num_steps``: distinct modules (fusion layer, decoder layers, norm), module i drafting
    depth i (multi-layer EAGLE, drafter/eagle/steps.py); 1 (every checkpoint written before
    the field) is the recurrent head. ``after_last_step``: what drafts past ``num_steps``
    (:data:`AFTER_LAST_STEP`).

    Raises:
        ValueError: ``num_steps`` below 1 or an unknown ``after_last_step``.
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int = 0
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    target: dict = field(default_factory=dict)
    feature_layers: tuple[int, ...] = ()
    num_steps: int = 1
    after_last_step: str = "repeat"

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        if int(self.num_steps) < 1 or self.after_last_step not in AFTER_LAST_STEP:
            raise ValueError(f"an EAGLE head needs num_steps >= 1 and after_last_step in "
                             f"{AFTER_LAST_STEP}, got {self.num_steps}, {self.after_last_step!r}")
        object.__setattr__(self, "num_steps", int(self.num_steps))

    def step_of_depth(self, depth: int) -> int | None:
        """The module (0-based) that drafts draft ``depth`` (1-based), None past the last one
        when ``after_last_step`` is "stop"."""
        if depth <= self.num_steps:
            return depth - 1
        return self.num_steps - 1 if self.after_last_step == "repeat" else None

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int = 0, num_layers: int = 1,
                   target: dict | None = None, feature_layers: tuple[int, ...] = (),
                   num_steps: int = 1,
                   after_last_step: str = "repeat") -> EagleHeadConfig:  # noqa: ANN001
        """A head of the target's layer shape (``target_config``: engine.config.ModelConfig).

        Raises:
            ValueError: ``feature_layers`` that are not distinct layers of the target.
        """
        c = target_config
        if feature_layers:
            check_hidden_layers(tuple(feature_layers), c.num_layers)
        return cls(hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                   head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                   vocab_size=c.vocab_size, draft_vocab_size=draft_vocab_size,
                   num_layers=num_layers, rms_norm_eps=c.rms_norm_eps,
                   rope_theta=c.rope_theta, target=dict(target or {}),
                   feature_layers=tuple(feature_layers), num_steps=num_steps,
                   after_last_step=after_last_step)
