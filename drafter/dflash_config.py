"""The shape and options of a DFlash draft (drafter/dflash_model.py), as its checkpoint's
``config.json`` stores them (drafter/dflash_files.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.drafter.checkpoint_config import HiddenRowsConfig
from specmesh.engine.hidden_layers import check_hidden_layers


@dataclass(frozen=True)
class DFlashConfig(HiddenRowsConfig):
    """Shape of a DFlash draft. ``hidden_size``, heads, ``intermediate_size`` and
    ``vocab_size`` follow the target; ``num_layers`` draft layers; ``feature_layers``: the
    target decoder layers whose outputs a context row carries (empty: the final-norm state);
    ``block``: k, the most drafts one forward makes (mask rows); ``draft_vocab_size``: rows
    of the target's LM head the draft scores (0: all; otherwise the checkpoint's
    ``draft_to_target`` ids, FR-Spec arXiv 2502.14856 / EAGLE-3's draft vocabulary: the LM
    head is most of a draft forward's cost); ``target``: the model it was trained for
    (drafter/eagle/checkpoint.py ``target_identity``); ``anchor_input``: the block's rows
    also read the anchor (module docstring); ``feature_norms``: each feature layer's part of a
    row is RMS-normed before the fusion, as EAGLE-3's fusion does (a late layer's residual
    stream is an order of magnitude larger than an early one's, and its few massive
    dimensions would otherwise fill ``hidden_norm``'s output); ``max_run_ahead``: most tokens
    past the anchor a block was trained to carry (None: ``block``), the limit the serving
    proposer keeps to."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_layers: int = 1
    block: int = 4
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    feature_layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0
    anchor_input: bool = False
    feature_norms: bool = False
    max_run_ahead: int | None = None
    target: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(x) for x in self.feature_layers))
        if self.num_layers < 1 or self.block < 1:
            raise ValueError(f"a DFlash draft needs num_layers >= 1 and block >= 1, got "
                             f"{self.num_layers}, {self.block}")
        if self.max_run_ahead is not None and self.max_run_ahead < 0:
            raise ValueError(f"max_run_ahead must be >= 0, got {self.max_run_ahead}")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is not in 0 .. "
                             f"{self.vocab_size}")

    @property
    def run_ahead_limit(self) -> int:
        """``max_run_ahead``, or ``block`` when the checkpoint does not say."""
        return self.block if self.max_run_ahead is None else self.max_run_ahead

    @property
    def num_draft_logits(self) -> int:
        """Columns of the draft's logits: ``draft_vocab_size``, or the whole vocabulary."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def for_target(cls, target_config, num_layers: int = 1, block: int = 4,  # noqa: ANN001
                   feature_layers: tuple[int, ...] = (), target: dict | None = None,
                   draft_vocab_size: int = 0, anchor_input: bool = False,
                   feature_norms: bool = False,
                   max_run_ahead: int | None = None) -> DFlashConfig:
        """A draft of the target's layer shape (``target_config``: engine.config.ModelConfig).

        Raises:
            ValueError: ``feature_layers`` that are not distinct layers of the target.
        """
        c = target_config
        if feature_layers:
            check_hidden_layers(tuple(feature_layers), c.num_layers)
        return cls(hidden_size=c.hidden_size, num_heads=c.num_heads,
                   num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                   intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
                   num_layers=num_layers, block=block, rms_norm_eps=c.rms_norm_eps,
                   rope_theta=c.rope_theta, feature_layers=tuple(feature_layers),
                   draft_vocab_size=draft_vocab_size, anchor_input=anchor_input,
                   feature_norms=feature_norms, max_run_ahead=max_run_ahead,
                   target=dict(target or {}))
