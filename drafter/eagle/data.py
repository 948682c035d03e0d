"""Self-distillation data for a feature head: the target's own greedy generations, with the
hidden states it computed on the way, generated in batches through specmesh's engine.

One :class:`Sample` per prompt: ``token_ids`` = prompt + greedy output, and ``features`` =
the target's final hidden states at positions ``prompt_len - 1 .. len(token_ids) - 2`` (the
state at the last prompt position is what a prefill worker ships as seed state; each later
one is what a verify forward computes). Generation is continuous batching over the engine's
paged KV: finished sequences leave the batch and new prompts are prefilled into their room.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.kv_cache import KVCache
from engine.runner import ModelRunner, SeqChunk


@dataclass
class Sample:
    """``features`` [len(token_ids) - prompt_len, width] start at position ``prompt_len - 1``
    (width: hidden_size, or hidden_size per captured layer)."""

    name: str
    token_ids: list[int]
    prompt_len: int
    features: torch.Tensor

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


def split_by_prompt(prompts: list[dict], heldout_fraction: float,
                    seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Split prompts (dicts with a unique ``name``) into train and held-out sets by a seeded
    hash of the name, so a prompt is on one side whatever the file order.

    Raises:
        ValueError: a fraction outside [0, 1), or duplicate names.
    """
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout fraction must be in [0, 1), got {heldout_fraction}")
    names = [p["name"] for p in prompts]
    if len(set(names)) != len(names):
        raise ValueError("prompt names must be unique to split by prompt")

    def score(name: str) -> float:
        h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    train = [p for p in prompts if score(p["name"]) >= heldout_fraction]
    held = [p for p in prompts if score(p["name"]) < heldout_fraction]
    return train, held


def chat_token_ids(tokenizer, prompts: list[dict]) -> list[list[int]]:  # noqa: ANN001
    """Token ids of each prompt's messages, tokenized as the gateway does for chat
    (``apply_chat_template(add_generation_prompt=True)``)."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def generate_samples(model, config, prompts: list[list[int]], names: list[str], *,  # noqa: ANN001
                     max_new_tokens: int, batch_size: int = 64, block_size: int = 16,
                     feature_dtype: torch.dtype = torch.bfloat16, progress=None,
                     hidden_layers: tuple[int, ...] | None = None) -> list[Sample]:
    """Greedy generations of ``model`` (engine.model.LlamaForCausalLM, ``config`` its
    ModelConfig) for token-id ``prompts``, up to ``max_new_tokens`` each or EOS, in
    continuous batches of up to ``batch_size`` sequences. ``progress(n_tokens)`` is called
    after every step with the tokens it produced. ``hidden_layers``: the features are those
    decoder layers' outputs side by side (EAGLE-3 fusion) instead of the final-norm state.
    Returns samples in prompt order.

    Raises:
        ValueError: a prompt longer than the model's positions allow with its new tokens.
    """
    limit = config.max_position_embeddings
    for ids in prompts:
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens "
                             f"exceeds max_position_embeddings {limit}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    per_seq = -(-longest // block_size)
    cache = KVCache(config, per_seq * batch_size, block_size, model.dtype, model.device)
    blocks = BlockManager(cache.num_blocks, block_size)
    runner = ModelRunner(model, config, cache)
    eos = set(config.eos_token_ids)
    results: list[Sample | None] = [None] * len(prompts)
    pending = list(range(len(prompts)))[::-1]
    active: dict[int, dict] = {}
    while pending or active:
        new = []
        while pending and len(active) + len(new) < batch_size:
            i = pending.pop()
            new.append(i)
        if new:
            tables = [blocks.allocate(per_seq) for _ in new]
            logits, hidden = runner.forward(
                [SeqChunk(list(prompts[i]), 0, t) for i, t in zip(new, tables)],
                logits="last", return_hidden=True, hidden_layers=hidden_layers)
            for i, t, lg, h in zip(new, tables, logits, hidden):
                active[i] = {"table": t, "out": [int(lg[-1].argmax())],
                             "feats": [h[-1].to(feature_dtype)]}
            if progress:
                progress(len(new))
        done = [i for i, s in active.items()
                if s["out"][-1] in eos or len(s["out"]) >= max_new_tokens]
        for i in done:
            s = active.pop(i)
            blocks.free(s["table"])
            results[i] = Sample(names[i], list(prompts[i]) + s["out"], len(prompts[i]),
                                torch.stack(s["feats"]))
        if not active:
            continue
        order = list(active)
        logits, hidden = runner.forward(
            [SeqChunk([active[i]["out"][-1]], len(prompts[i]) + len(active[i]["out"]) - 1,
                      active[i]["table"]) for i in order], logits="all", return_hidden=True,
            hidden_layers=hidden_layers)
        for i, lg, h in zip(order, logits, hidden):
            active[i]["out"].append(int(lg[-1].argmax()))
            active[i]["feats"].append(h[-1].to(feature_dtype))
        if progress:
            progress(len(order))
    # feats hold f_{p-1} .. f_{L-2}: one row per output token (the last one is never fed)
    return [s for s in results if s is not None]


def shuffled(items: list, seed: int) -> list:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out
