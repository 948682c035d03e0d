"""Multi-layer EAGLE: a head of ``num_steps`` distinct modules, module i drafting depth i.

A 1-module EAGLE head (drafter/eagle/head.py) runs its one module recurrently: draft k reads
the state draft k-1 predicted, through the same weights. A multi-layer head (the chapter's
"multi-layer EAGLE"; DeepSeek-V3's MTP modules, arXiv 2412.19437, and vLLM / SGLang's
``num_nextn_predict_layers`` are the same shape) has one module per draft depth: module 0 is
the 1-module head (it reads the target's true states), module i >= 1 reads the state module
i - 1 predicted and the token after it. Past the last module the head repeats it recurrently
or stops (``after_last_step``, drafter/eagle/config.py).

Each module has its own KV over the context (the proposer's per-module
:class:`~drafter.eagle.head_kv.HeadKV`): module i's entry at position p reads module i-1's
predicted state at p-1 and the token at p+1 (module 0's: the target's state at p), so module
i's KV starts i positions after module 0's. A draft at depth j >= 2 is one entry of module
j - 1 at position ``L - 2 + (j - 1)`` (context of L tokens) that attends to that module's
context entries (positions <= L - 2) and to itself, plus, for a repeated last module, to the
entries of the chain it drafted before (the 1-module head's chain). :func:`forward_steps` is
the same computation over whole training sequences, so a module trains on the states the
module before it produces, as the draft runs at serve time.

Cost: module i's resident weights (:func:`step_weight_bytes`) are read once per depth it
drafts, and every module keeps a KV entry per context position: a chain of k drafts costs
``sum(c_i)`` over the modules it runs instead of k times one module's ``c``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafter.eagle.layer import DecoderLayer, RMSNorm
from specmesh.engine.linear import RowInvariantLinear

if TYPE_CHECKING:
    from specmesh.drafter.eagle.config import EagleHeadConfig
    from specmesh.engine.backend import CpuBackend

#: the functions below take the EAGLE head (drafter/eagle/head.py's ``EagleHead``, which
#: imports this module) as a plain module
EagleHead = nn.Module


class StepModule(nn.Module):
    """Module i >= 1 of a multi-layer head: ``fc`` (2d -> d, the token's embedding and the
    state module i - 1 predicted), ``layers`` (``num_layers`` decoder layers of the target's
    shape) and ``norm``, the names module 0 has on the head itself."""

    def __init__(self, c: EagleHeadConfig, backend: CpuBackend | None = None) -> None:
        super().__init__()
        d = c.hidden_size
        self.fc = RowInvariantLinear(2 * d, d, bias=False, backend=backend)
        self.layers = nn.ModuleList([DecoderLayer(c, backend) for _ in range(c.num_layers)])
        self.norm = RMSNorm(d, c.rms_norm_eps)


def _read_bytes(module: nn.Module) -> int:
    """Bytes one forward of ``module`` reads of its weights: an attached Q8_0 copy
    (drafter/eagle/quantize.py) instead of its float weight."""
    n = 0
    for sub in module.modules():
        blocks = getattr(sub, "_blocks", None)
        for name, p in sub.named_parameters(recurse=False):
            n += blocks.nbytes if blocks is not None and name == "weight" \
                else p.numel() * p.element_size()
    return n


def step_weight_bytes(head: EagleHead) -> list[int]:
    """Per module the bytes of weights one of its forwards reads (what its cost ``c_i`` is
    bound by on a CPU): its own weights (module 0 with the EAGLE-3 fusion) plus the LM head
    over the draft vocabulary, which every depth's draft reads; on Q8_0 blocks where the head
    computes on them. A chain's ``sum(c_i)`` in bytes is the sum over the modules it runs."""
    lm = head.lm_head_blocks[0].nbytes if head.lm_head_blocks is not None \
        else head.lm_head.numel() * head.lm_head.element_size()
    first = _read_bytes(head.fc) + sum(_read_bytes(m) for m in
                                       (head.layers, head.norm, head.feature_norms))
    if head.fuse is not None:
        first += _read_bytes(head.fuse)
    return [first + lm] + [_read_bytes(s) + lm for s in head.steps]


def forward_steps(head: EagleHead, features: torch.Tensor, next_tokens: torch.Tensor,
                  positions: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """``depth`` passes of a multi-layer head over whole sequences (training, evaluation):
    :meth:`EagleHead.forward_passes` of a head with ``num_steps`` > 1.

    Pass k (1-based) runs module ``m = step_of_depth(k)``; its row s reads the state pass
    k - 1 predicted at row s - 1 (pass 1: the true state at s) and the token at s + 1, and
    attends to what the draft at depth k of a chain started from true states up to s - k + 1
    attends to at serve time: module m's context rows (pass m + 1 rows ``m .. s - k + 1``),
    the rows of the same chain in module m's earlier passes (``s - k + q`` of pass q, a
    repeated last module) and itself. A depth past the last module of a "stop" head ends the
    passes.

    Args / returns: as :meth:`EagleHead.forward_passes` (a list of up to ``depth`` tensors
    ``[B, S, d]``).
    """
    c = head.config
    first = head.seed_features(features)
    B, S, _ = first.shape
    cos, sin = head._cos_sin(positions, first.dtype)
    cos, sin = cos[:, None], sin[:, None]
    emb = head.embed[next_tokens]
    idx = torch.arange(S, device=first.device)
    row, key = idx[:, None], idx[None, :]
    outs: list[torch.Tensor] = []
    kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # pass -> per layer (k, v)
    prev = first
    for k in range(1, depth + 1):
        m = c.step_of_depth(k)
        if m is None:
            break
        fc, layers, norm = head.step_parts(m)
        feat = first if k == 1 else torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)
        x = fc(torch.cat([emb, feat], dim=-1))
        same = [q for q in range(m + 1, k) if c.step_of_depth(q) == m]  # earlier passes of m
        masks = []
        for q in [*same, k]:
            chain = key == (row - k + q)
            if q == m + 1:  # module m's context rows
                chain = chain | ((key >= m) & (key <= row - k + 1))
            masks.append(chain)
        mask = torch.cat(masks, dim=1)  # [S, (len(same) + 1) * S]; every row sees itself
        new = []
        for li, layer in enumerate(layers):
            q_, kk, vv = layer.qkv(x, cos, sin)
            new.append((kk, vv))
            keys = torch.cat([kv[q][li][0] for q in same] + [kk], dim=2)
            vals = torch.cat([kv[q][li][1] for q in same] + [vv], dim=2)
            attn = F.scaled_dot_product_attention(q_, keys, vals, attn_mask=mask,
                                                  enable_gqa=layer.nh != layer.nkv)
            x = layer.finish(x, attn)
        kv[k] = new
        prev = norm(x)
        outs.append(prev)
    return outs


__all__ = ["StepModule", "forward_steps", "step_weight_bytes"]
