"""A small draft model self-distilled from its target (``specmesh train-drafter --method
draft-model``), saved as a Hugging Face dir that ``--drafter draft-model:PATH`` loads.

The draft is the target's architecture (a transformers ``LlamaForCausalLM``; a Qwen2 target
gets a Qwen2 draft, so its attention biases fit) with the target's hidden size, heads,
vocabulary, RoPE and tie setting and ``num_layers`` decoder layers. It starts from the
target's embedding, LM head and final norm, and its layers (``init_layers``) from:

- ``"first"`` (default): the target's first ``num_layers`` layers, i.e. the target truncated
  (an early exit through the final norm and LM head). The layers see the residual stream they
  were trained on; on SmolLM2-135M (30 layers) a 2-layer draft starts at cross-entropy 17 vs
  65 for ``"spread"`` and 55 for random, and after the same 24 steps (32 prompts, lr 1e-3)
  accepts 0.16 / 0.12 / 0.06 of first drafts on held-out prompts.
- ``"spread"``: ``num_layers`` layers evenly spaced from the first to the last (the first
  reads the raw embeddings, the last writes what the final norm and LM head were trained on),
  but the last layers expect a residual stream that a jump from the first does not give them.
- ``"random"``: freshly drawn layers.

Training is teacher forcing on the samples of drafter/eagle/data.py (prompt + the target's
greedy output): at every output position the loss is ``(1 - kl_weight)`` times the
cross-entropy against the target's greedy token plus ``kl_weight`` times KL(target || draft),
the target's distribution computed from the stored final hidden states through the target's
LM head. AdamW, linear warm-up then cosine decay. The embedding and LM head stay the
target's unless ``train_embeddings``.

Acceptance at draft position k (:func:`acceptance`) is the share of output positions at which
the draft model, drafting greedily from the true prefix, proposes k tokens that all equal the
target's next k tokens. As for the EAGLE head's numbers (so the two are comparable), chains
start at the second output token (the first comes from prefill, never from a draft) and a
chain running past the end of the sample counts as a miss.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specmesh.drafter.eagle.data import Sample, shuffled
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.config import ModelConfig
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.runner import ModelRunner, SeqChunk

INIT_LAYERS = ("first", "spread", "random")


def layer_sources(num_target_layers: int, num_layers: int, how: str = "first") -> list[int]:
    """Target layers a draft of ``num_layers`` layers starts from: the first ones
    (``"first"``) or evenly spaced, first and last included (``"spread"``; one layer: the
    first)."""
    if not 1 <= num_layers <= num_target_layers:
        raise ValueError(f"a draft model needs 1..{num_target_layers} layers (the target's "
                         f"count), got {num_layers}")
    if how == "first" or num_layers == 1:
        return list(range(num_layers))
    if how != "spread":
        raise ValueError(f"layer sources are 'first' or 'spread', got {how!r}")
    step = (num_target_layers - 1) / (num_layers - 1)
    return [round(i * step) for i in range(num_layers)]


def draft_hf_config(target_hf_config: Any, num_layers: int) -> Any:
    """The target's transformers config with ``num_layers`` decoder layers."""
    cfg = copy.deepcopy(target_hf_config)
    cfg.num_hidden_layers = num_layers
    for key in ("layer_types",):  # per-layer lists (Qwen2 in transformers >= 4.5x)
        value = getattr(cfg, key, None)
        if isinstance(value, list):
            setattr(cfg, key, value[:num_layers])
    if hasattr(cfg, "max_window_layers"):
        cfg.max_window_layers = min(cfg.max_window_layers, num_layers)
    cfg._attn_implementation = "sdpa"
    return cfg


def init_draft_model(target: torch.nn.Module, target_hf_config: Any, num_layers: int,
                     init_layers: str = "first", seed: int = 0) -> tuple[Any, list[int] | None]:
    """A float32 transformers model for ``target`` (engine.model.LlamaForCausalLM, whose
    parameter names are transformers'), initialised as the module docstring says.

    Returns:
        (the model in train mode, the target layers copied or None for ``"random"``).
    """
    from transformers import AutoModelForCausalLM  # transformers: slow to import

    if init_layers not in INIT_LAYERS:
        raise ValueError(f"init_layers must be one of {INIT_LAYERS}, got {init_layers!r}")
    cfg = draft_hf_config(target_hf_config, num_layers)
    torch.manual_seed(seed)
    draft = AutoModelForCausalLM.from_config(cfg).float()
    src = target.state_dict()
    sources = (None if init_layers == "random" else
               layer_sources(len(target.model.layers), num_layers, init_layers))
    with torch.no_grad():
        for name, p in draft.state_dict().items():
            if name.startswith("model.layers."):
                if sources is None:
                    continue
                _, _, j, rest = name.split(".", 3)
                key = f"model.layers.{sources[int(j)]}.{rest}"
            else:
                key = name
            if key not in src:
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                raise ValueError(f"the target has no weight {key!r} for the draft's {name!r}")
            p.copy_(src[key].float())
    if cfg.tie_word_embeddings:
        draft.tie_weights()
    return draft.train(), sources


# -- training ------------------------------------------------------------------------------


def collate(batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor, torch.Tensor]:
    """Right-padded inputs [B, S] (each sample but its last token) and, flat over the batch's
    N output positions: row and column of the hidden state that predicts each output token,
    its label (the target's greedy token) and the target's feature there [N, d]."""
    S = max(len(s.token_ids) - 1 for s in batch)
    ids = torch.zeros(len(batch), S, dtype=torch.long)
    rows, cols, labels, feats = [], [], [], []
    for b, s in enumerate(batch):
        n, p = len(s.token_ids), s.prompt_len
        ids[b, : n - 1] = torch.tensor(s.token_ids[:-1])
        rows.append(torch.full((n - p,), b))
        cols.append(torch.arange(p - 1, n - 1))
        labels.append(torch.tensor(s.label_ids[p:]))
        feats.append(s.features)
    return ids, torch.cat(rows), torch.cat(cols), torch.cat(labels), torch.cat(feats)


def distill_loss(draft: Any, ids: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 labels: torch.Tensor, feats: torch.Tensor, target_lm_head: torch.Tensor,
                 kl_weight: float) -> tuple[torch.Tensor, float, float]:
    """(loss, cross-entropy, KL) of one batch; logits only at the output positions."""
    hidden = draft.model(input_ids=ids, use_cache=False).last_hidden_state[rows, cols]
    logp = F.log_softmax(draft.lm_head(hidden).float(), dim=-1)
    ce = F.nll_loss(logp, labels)
    if not kl_weight:
        return ce, float(ce.detach()), 0.0
    with torch.no_grad():
        logq = F.log_softmax(feats.float() @ target_lm_head.float().T, dim=-1)
    kl = F.kl_div(logp, logq, log_target=True, reduction="batchmean")
    loss = (1 - kl_weight) * ce + kl_weight * kl
    return loss, float(ce.detach()), float(kl.detach())


def lr_schedule(lr: float, total_steps: int, warmup_steps: int):  # noqa: ANN201
    """lr at a step: linear warm-up over ``warmup_steps``, then cosine decay to 5 %."""
    def lr_at(step: int) -> float:
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
    return lr_at


def optimizer_and_schedule(params: list, num_samples: int, *, epochs: float, batch_size: int,
                           lr: float, warmup_steps: int):  # noqa: ANN201
    """AdamW over ``params`` (the draft's trainable tensors) and its steps: ``(optimizer,
    total_steps, lr_at)`` for ``epochs`` (may be fractional) of ``num_samples`` in batches of
    ``batch_size``, warm-up at most a tenth of the steps (:func:`lr_schedule`)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = max(1, math.ceil(num_samples / batch_size))
    total_steps = max(1, int(round(epochs * steps_per_epoch)))
    return opt, total_steps, lr_schedule(lr, total_steps,
                                         max(1, min(warmup_steps, total_steps // 10)))


def train(draft: Any, samples: list[Sample], target_lm_head: torch.Tensor, *, epochs: float,
          batch_size: int, lr: float, kl_weight: float = 0.5, seed: int = 0,
          warmup_steps: int = 20, train_embeddings: bool = False,
          progress: bool = True) -> dict:
    """AdamW over ``epochs`` (may be fractional) of ``samples`` (batches of whole samples);
    returns a summary (steps, seconds, tokens/s, last loss)."""
    samples = [s for s in samples if s.num_output_tokens > 0]
    if not samples:
        raise ValueError("no training sample has an output token")
    torch.manual_seed(seed)
    frozen = {id(draft.model.embed_tokens.weight), id(draft.lm_head.weight)}
    params = [p for p in draft.parameters() if train_embeddings or id(p) not in frozen]
    for p in draft.parameters():
        p.requires_grad_(any(p is q for q in params))
    opt, total_steps, lr_at = optimizer_and_schedule(
        params, len(samples), epochs=epochs, batch_size=batch_size, lr=lr,
        warmup_steps=warmup_steps)
    draft.train()
    t0 = time.perf_counter()
    tokens = step = epoch = 0
    loss_val = ce = kl = float("nan")
    bar = tqdm(total=total_steps, desc="train", unit="step", disable=not progress)
    while step < total_steps:
        order = shuffled(samples, seed + epoch)
        epoch += 1
        for lo in range(0, len(order), batch_size):
            if step >= total_steps:
                break
            ids, rows, cols, labels, feats = collate(order[lo:lo + batch_size])
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss, ce, kl = distill_loss(draft, ids, rows, cols, labels, feats, target_lm_head,
                                        kl_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            tokens += len(labels)
            step += 1
            loss_val = float(loss.detach())
            rate = tokens / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss_val:.3f}", ce=f"{ce:.3f}", kl=f"{kl:.3f}",
                            tok_s=f"{rate:.0f}")
            bar.update(1)
    bar.close()
    draft.eval()
    secs = time.perf_counter() - t0
    return {"steps": step, "seconds": round(secs, 1), "tokens_per_s": round(tokens / secs, 1),
            "last_loss": round(loss_val, 4), "last_ce": round(ce, 4), "last_kl": round(kl, 4),
            "epochs": epochs}


# -- evaluation ----------------------------------------------------------------------------


@torch.no_grad()
def acceptance(model: torch.nn.Module, config: ModelConfig, samples: list[Sample], depth: int,
               batch_size: int = 16, block_size: int = 16) -> list[float]:
    """Acceptance per draft position 1..``depth`` of the draft ``model`` (engine's
    LlamaForCausalLM, ``config`` its ModelConfig) over the output positions of ``samples``
    but the first (prefill's token): at output position j it drafts greedily from the true
    prefix ``token_ids[:j]`` (as DraftModelProposer does), and position k counts a hit when
    drafts 1..k equal ``token_ids[j:j + k]``. Samples run side by side in the engine's paged
    KV; a chain stops being extended at its first miss."""
    hits = [0] * depth
    total = 0
    samples = [s for s in samples if s.num_output_tokens > 1]
    for lo in range(0, len(samples), batch_size):
        group = samples[lo:lo + batch_size]
        per_seq = -(-(max(len(s.token_ids) for s in group) + depth) // block_size)
        cache = KVCache(config, per_seq * len(group), block_size, model.dtype, model.device)
        blocks = BlockManager(cache.num_blocks, block_size)
        runner = ModelRunner(model, config, cache)
        tables = [blocks.allocate(per_seq) for _ in group]
        first = [s.prompt_len + 1 for s in group]
        nxt = list(first)  # chain start: the output position drafted next
        while True:
            act = [i for i, s in enumerate(group) if nxt[i] < len(s.token_ids)]
            if not act:
                break
            # the KV holds the true tokens before nxt - 1 (each step feeds one more; the first
            # feeds the prompt and prefill's token); later slots hold stale drafts, past every
            # kv_len
            chunks = [SeqChunk(group[i].token_ids[:nxt[i]], 0, tables[i])
                      if nxt[i] == first[i] else
                      SeqChunk([group[i].token_ids[nxt[i] - 1]], nxt[i] - 1, tables[i])
                      for i in act]
            logits = runner.forward(chunks, logits="last")
            alive = act
            for k in range(depth):
                drafts = {i: int(lg[-1].argmax()) for i, lg in zip(alive, logits)}
                alive = [i for i in alive if nxt[i] + k < len(group[i].token_ids)
                         and drafts[i] == group[i].token_ids[nxt[i] + k]]
                hits[k] += len(alive)
                if not alive or k == depth - 1:
                    break
                logits = runner.forward([SeqChunk([drafts[i]], nxt[i] + k, tables[i])
                                         for i in alive], logits="last")
            total += len(act)
            for i in act:
                nxt[i] += 1
    return [h / max(total, 1) for h in hits]
