"""Training and evaluating a PARD draft model (``specmesh train-drafter --method pard``).

The draft starts as ``draft-model``'s does (drafter/draft_model_training.py,
``init_draft_model``): the target's architecture with its first ``num_layers`` layers, final
norm, embedding and LM head. It learns to fill a block of mask tokens: the objective is PARD's
(arXiv 2504.18583; AMD-AGI/PARD ``pard_train.py``) cross-entropy over the COD layout of
drafter/pard_block.py, i.e. at every anchor the next token (copy 0, the real tokens) and the
tokens 2 .. K ahead (mask copies 1 .. K-1), all anchors of a sample in one forward under a 4-D
attention mask. Labels are the target's greedy tokens (the samples of drafter/eagle/data.py:
prompts + the target's own output). The embedding and LM head stay the target's (frozen, not
stored); trained are the layers, the final norm and ``mask_embedding``, the input vector of
the mask token (a new vector, not a vocabulary row: the checkpoint names an id, unused by the
data, that stands for it in the token lists).

Acceptance at draft position k (:func:`acceptance`) is measured with the serving proposer
itself (drafter/proposers/pard.py) on the held-out samples: at every output position but the
first (prefill's token) one block forward from the true prefix, and position k counts a hit
when drafts 1..k all equal the target's next k tokens (the EAGLE head's and draft model's
numbers count the same way).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from specmesh.drafter.eagle.data import Sample
from specmesh.drafter.pard_block import IGNORE, cod_layout, collate_layouts, keep_schedule
from specmesh.drafter.proposer import ProposeCall
from specmesh.drafter.train_steps import TrainSteps


def choose_mask_token(tokenizer: Any, samples: list[Sample], vocab_size: int) -> int:
    """The id that stands for the mask: the largest special or added token id of ``tokenizer``
    (SmolLM2: ``<empty_output>``, 16) that no sample holds, else the largest id below
    ``vocab_size`` that no sample holds.

    Raises:
        ValueError: every id occurs in the samples.
    """
    seen = {t for s in samples for t in s.token_ids}
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", None) or {})
    special = sorted(special, reverse=True)
    for t in special:
        if 0 <= t < vocab_size and t not in seen:
            return int(t)
    for t in range(vocab_size - 1, -1, -1):
        if t not in seen:
            return t
    raise ValueError("every vocabulary id occurs in the training samples: no id for the mask")


def pard_loss(draft: Any, mask_embedding: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
              labels: torch.Tensor, mask4d: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """Cross-entropy of a collated COD batch (:func:`drafter.pard_block.collate_layouts`);
    logits only at labelled rows."""
    emb = draft.model.embed_tokens(ids)
    emb = torch.where((ids == mask_token_id)[..., None], mask_embedding.to(emb.dtype), emb)
    hidden = draft.model(inputs_embeds=emb, attention_mask=mask4d, position_ids=pos,
                         use_cache=False).last_hidden_state
    sel = labels != IGNORE
    logits = draft.lm_head(hidden[sel]).float()
    return F.cross_entropy(logits, labels[sel])


def train(draft: Any, samples: list[Sample], *, mask_token_id: int, block: int, epochs: float,
          batch_size: int, lr: float, seed: int = 0, warmup_steps: int = 20,
          cod_ratio: float = 0.7, cod_floor: float = 0.2, max_seconds: float | None = None,
          autocast_dtype: torch.dtype | None = None, progress: bool = True
          ) -> tuple[torch.Tensor, dict]:
    """AdamW over ``epochs`` of ``samples`` (or until ``max_seconds``); the embedding and LM
    head frozen. Returns (the trained mask embedding [d], a summary)."""
    samples = [s for s in samples if s.num_output_tokens > 2]
    if not samples:
        raise ValueError("no training sample has more than 2 output tokens")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    keep = keep_schedule(block, cod_ratio, cod_floor)
    embed = draft.model.embed_tokens.weight
    mask_embedding = torch.nn.Parameter(embed[mask_token_id].detach().clone().float())
    frozen = {id(embed), id(draft.lm_head.weight)}
    params = [p for p in draft.parameters() if id(p) not in frozen]
    for p in draft.parameters():
        p.requires_grad_(id(p) not in frozen)
    params.append(mask_embedding)
    steps = TrainSteps(params, samples, epochs=epochs, batch_size=batch_size, lr=lr,
                       warmup_steps=warmup_steps, seed=seed, max_seconds=max_seconds,
                       desc="train pard", progress=progress)
    draft.train()
    for group in steps:
        layouts = [cod_layout(s.token_ids, s.label_ids, s.prompt_len - 1, block,
                              mask_token_id, keep, gen) for s in group]
        ids, pos, labels, mask4d = collate_layouts(layouts)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            loss = pard_loss(draft, mask_embedding, ids, pos, labels, mask4d, mask_token_id)
        steps.update(loss, int((labels != IGNORE).sum()))
    draft.eval()
    return mask_embedding.detach(), {
        **steps.summary(), "epochs": epochs, "block": block,
        "cod_keep": [round(k, 4) for k in keep],
        "autocast": str(autocast_dtype).replace("torch.", "") if autocast_dtype else "none"}


def serving_state(draft: Any, mask_embedding: torch.Tensor, mask_token_id: int
                  ) -> dict[str, torch.Tensor]:
    """The transformers state dict of ``draft`` with the mask vector in the embedding row
    ``mask_token_id`` (a copy), as :func:`drafter.pard_files.build_pard_model` builds it."""
    state = {k: v.detach().float() for k, v in draft.state_dict().items()}
    embed = state["model.embed_tokens.weight"].clone()
    embed[mask_token_id] = mask_embedding.float()
    state["model.embed_tokens.weight"] = embed
    if getattr(draft.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


@torch.inference_mode()
def acceptance(proposer: Any, samples: list[Sample], depth: int,
               batch_size: int = 16) -> list[float]:
    """Acceptance per draft position 1..``depth`` of ``proposer`` (a PardProposer) over the
    output positions of ``samples`` but the first (module docstring); ``batch_size`` samples
    share each block forward (``propose_many``)."""
    hits = [0] * depth
    total = 0
    samples = [s for s in samples if s.num_output_tokens > 1]
    for lo in range(0, len(samples), batch_size):
        group = samples[lo:lo + batch_size]
        names = [f"eval-{lo + i}" for i in range(len(group))]
        nxt = [s.prompt_len + 1 for s in group]
        while True:
            act = [i for i, s in enumerate(group) if nxt[i] < len(s.token_ids)]
            if not act:
                break
            out = proposer.propose_many([ProposeCall(names[i], group[i].token_ids[:nxt[i]],
                                                     depth) for i in act])
            for i, (drafts, _) in zip(act, out):
                ids = group[i].token_ids
                for k in range(depth):
                    if (k >= len(drafts) or nxt[i] + k >= len(ids)
                            or drafts[k] != ids[nxt[i] + k]):
                        break
                    hits[k] += 1
                total += 1
                nxt[i] += 1
        for name in names:
            proposer.close(name)
    return [h / max(total, 1) for h in hits]
