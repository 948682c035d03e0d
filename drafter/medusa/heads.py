"""The Medusa heads' math (Medusa-1, arXiv 2401.10774; FasterDecoding/Medusa ``ResBlock``).

Head ``i`` (0-based, ``i < num_heads``) reads the target's final hidden state ``h_s`` [d]
(final-norm output, the input of its LM head) at position ``s``, the state from which the
target itself predicts the token at ``s + 1``, and predicts the token at ``s + 2 + i``: one
residual block ``r_i = h_s + SiLU(W_i h_s + b_i)`` fed to the target's own LM head (frozen,
read from the target's weights at load time, never stored with the heads). ``W_i`` starts at
zero (as Medusa initialises it; ``b_i`` as ``nn.Linear`` does), so an untrained head is the
target's LM head on ``h_s + SiLU(b_i)``: close to the target's own next-token distribution.
The LM head keeps only the rows of a draft vocabulary (the most frequent output
tokens, as the EAGLE head does): at SmolLM2's 49k vocabulary its product is the heads' cost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafter.checkpoint_config import CheckpointConfig


@dataclass(frozen=True)
class MedusaConfig(CheckpointConfig):
    """Shape of a set of heads: ``num_heads`` (K) heads of width ``hidden_size`` (the
    target's), ``draft_vocab_size`` rows of the target's LM head kept (0: all
    ``vocab_size``), ``target`` the model they were trained for (drafter/eagle/checkpoint.py
    ``target_identity``), ``tree`` the static draft tree (drafter/medusa/tree.py: one path of
    per-head ranks per node, parents before children), ``heldout`` what the trainer measured
    (per-head accuracy, chain and tree acceptance)."""

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    draft_vocab_size: int = 0
    target: dict = field(default_factory=dict)
    tree: tuple[tuple[int, ...], ...] = ()
    heldout: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", tuple(tuple(int(r) for r in p) for p in self.tree))
        if self.num_heads < 1 or self.hidden_size < 1:
            raise ValueError(f"need num_heads >= 1 and hidden_size >= 1, got {self.num_heads}, "
                             f"{self.hidden_size}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tree"] = [list(p) for p in self.tree]
        return d



class MedusaHeads(nn.Module):
    """Trainable parameters: ``weight`` [K, d, d] and ``bias`` [K, d] (the K residual
    blocks, one matrix each). Frozen buffers set by :meth:`set_target_weights`: ``lm_head``
    [draft_vocab, d] (the target's LM-head rows) and ``draft_to_target`` [draft_vocab]."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        k, d = config.num_heads, config.hidden_size
        self.weight = nn.Parameter(torch.zeros(k, d, d))  # zero: Medusa's initialisation
        bound = 1.0 / d ** 0.5  # nn.Linear's bias initialisation
        self.bias = nn.Parameter(torch.empty(k, d).uniform_(-bound, bound))
        n_draft = config.draft_vocab_size or config.vocab_size
        self.register_buffer("lm_head", torch.zeros(n_draft, d), persistent=False)
        self.register_buffer("draft_to_target", torch.arange(n_draft), persistent=False)

    def set_target_weights(self, lm_head: torch.Tensor,
                           draft_to_target: torch.Tensor | None = None) -> None:
        """Install the target's LM head [vocab, d], keeping the rows ``draft_to_target``
        (LongTensor [draft_vocab]; default all rows).

        Raises:
            ValueError: shapes that do not fit the config.
        """
        c = self.config
        if tuple(lm_head.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"target LM head {tuple(lm_head.shape)} does not fit heads for "
                             f"vocab {c.vocab_size}, hidden {c.hidden_size}")
        n_draft = c.draft_vocab_size or c.vocab_size
        ids = torch.arange(c.vocab_size) if draft_to_target is None else draft_to_target.long()
        if ids.shape != (n_draft,) or int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"draft vocabulary of {tuple(ids.shape)} ids does not fit "
                             f"draft_vocab_size {n_draft} / vocab {c.vocab_size}")
        self.lm_head = lm_head.detach()[ids].to(self.weight.dtype).clone()
        self.draft_to_target = ids.clone()

    def states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The heads' residual-block outputs [K, n, d] of target states ``hidden`` [n, d]."""
        x = hidden.to(self.weight.dtype)
        pre = torch.baddbmm(self.bias[:, None, :], x.expand(self.config.num_heads, -1, -1),
                            self.weight.transpose(1, 2))
        return x + F.silu(pre)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [K, n, draft_vocab] of target states ``hidden`` [n, d]:
        row ``[i, j]`` is head i's distribution of the token ``i + 2`` positions after the
        one state j sits at."""
        return self.states(hidden) @ self.lm_head.T

    def top_tokens(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Target token ids [n, K, k]: each head's ``k`` most likely tokens, best first, for
        each state of ``hidden`` [n, d]."""
        k = min(k, self.lm_head.shape[0])
        with torch.inference_mode():
            top = self(hidden).topk(k, dim=-1).indices  # [K, n, k]
        return self.draft_to_target[top].permute(1, 0, 2).contiguous()

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
