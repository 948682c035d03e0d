"""Self-distillation data for a feature head: the target's own greedy generations, with the
hidden states it computed on the way, generated in batches through specmesh's engine.

One :class:`Sample` per prompt: ``token_ids`` = prompt + greedy output, and ``features`` =
the target's final hidden states at positions ``prompt_len - 1 .. len(token_ids) - 2`` (the
state at the last prompt position is what a prefill worker ships as seed state; each later
one is what a verify forward computes). Generation is continuous batching through the
engine's model over contiguous per-sequence KV (engine/dense_kv.py: offline, so no batch
invariance is needed): finished sequences leave the batch and new prompts take their slots.
Continuations may also be sampled, with the target's greedy token of every position kept as
the label (more varied prefixes per prompt, same supervision).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

from specmesh.engine.dense_kv import DenseBatch, DenseKVCache


@dataclass
class Sample:
    """``features`` [len(token_ids) - prompt_len, width] start at position ``prompt_len - 1``
    (width: hidden_size, or hidden_size per captured layer). ``target_ids`` (None when the
    outputs are the target's greedy tokens themselves): for a sampled continuation, the
    target's greedy choice at each output position, one per output token; the labels a head
    learns (the drafter must guess the verifier's greedy token, whatever prefix led there)."""

    name: str
    token_ids: list[int]
    prompt_len: int
    features: torch.Tensor
    target_ids: list[int] | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def label_ids(self) -> list[int]:
        """``token_ids`` with each output token replaced by the target's greedy choice at
        that position (equal to ``token_ids`` for a greedy sample)."""
        if self.target_ids is None:
            return self.token_ids
        return self.token_ids[:self.prompt_len] + list(self.target_ids)


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
                     max_new_tokens: int, batch_size: int = 64,
                     feature_dtype: torch.dtype = torch.bfloat16, progress=None,
                     hidden_layers: tuple[int, ...] | None = None,
                     temperatures: list[float] | None = None, seed: int = 0) -> list[Sample]:
    """Generations of ``model`` (engine.model.LlamaForCausalLM, ``config`` its ModelConfig)
    for token-id ``prompts``, up to ``max_new_tokens`` each or EOS, in continuous batches of
    up to ``batch_size`` sequences over a :class:`~engine.dense_kv.DenseKVCache` (one slot
    per sequence; a finished one's slot takes the next prompt). ``progress(n_tokens)`` is
    called after every step with the tokens it produced. ``hidden_layers``: the features are
    those decoder layers' outputs side by side (EAGLE-3 fusion) instead of the final-norm
    state. ``temperatures`` (one per prompt; None or 0: greedy): a prompt with T > 0 continues
    with tokens sampled from softmax(logits / T) (a torch generator seeded with ``seed``) and
    records the greedy token of every position as ``target_ids``. Returns samples in prompt
    order.

    Raises:
        ValueError: a prompt longer than the model's positions allow with its new tokens, or
            ``temperatures`` not one per prompt or negative.
    """
    limit = config.max_position_embeddings
    for ids in prompts:
        if len(ids) + max_new_tokens > limit:
            raise ValueError(f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens "
                             f"exceeds max_position_embeddings {limit}")
    temps = list(temperatures) if temperatures is not None else [0.0] * len(prompts)
    if len(temps) != len(prompts) or any(t < 0 for t in temps):
        raise ValueError("temperatures: one value >= 0 per prompt")
    gen = torch.Generator(device=model.device).manual_seed(seed)
    longest = max(len(p) for p in prompts) + max_new_tokens
    slots = min(batch_size, len(prompts))
    cache = DenseKVCache(config, slots, longest, model.dtype, model.device)
    eos = set(config.eos_token_ids)
    results: list[Sample | None] = [None] * len(prompts)
    pending = list(range(len(prompts)))[::-1]
    free = list(range(slots))[::-1]
    active: dict[int, dict] = {}

    def forward(order: list[int], chunks: list[list[int]], starts: list[int]):  # noqa: ANN202
        batch = DenseBatch([active[i]["slot"] for i in order], starts, [len(c) for c in chunks])
        cache.check(batch)
        flat = [t for c in chunks for t in c]
        pos = [p for c, s in zip(chunks, starts) for p in range(s, s + len(c))]
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0) - 1
        with torch.inference_mode():
            logits, hidden = model(torch.tensor(flat, device=model.device),
                                   torch.tensor(pos, device=model.device), batch, cache,
                                   return_hidden=True, logits_indices=ends.to(model.device),
                                   hidden_layers=hidden_layers)
        logits = logits.float()
        greedy = logits.argmax(-1).tolist()
        tokens = list(greedy)
        hot = [j for j, i in enumerate(order) if temps[i] > 0]
        if hot:  # one batched draw for every sampled row
            t = torch.tensor([temps[order[j]] for j in hot], device=logits.device)[:, None]
            drawn = torch.multinomial(torch.softmax(logits[hot] / t, dim=-1), 1, generator=gen)
            for j, token in zip(hot, drawn.view(-1).tolist()):
                tokens[j] = token
        feats = hidden[ends].to(feature_dtype)
        for j, i in enumerate(order):
            s = active[i]
            s["out"].append(tokens[j])
            s["greedy"].append(greedy[j])
            s["feats"].append(feats[j])
        if progress:
            progress(len(order))

    while pending or active:
        new = []
        while pending and free:
            i = pending.pop()
            active[i] = {"slot": free.pop(), "out": [], "greedy": [], "feats": []}
            new.append(i)
        if new:
            forward(new, [list(prompts[i]) for i in new], [0] * len(new))
        done = [i for i, s in active.items()
                if s["out"][-1] in eos or len(s["out"]) >= max_new_tokens]
        for i in done:
            s = active.pop(i)
            free.append(s["slot"])
            results[i] = Sample(names[i], list(prompts[i]) + s["out"], len(prompts[i]),
                                torch.stack(s["feats"]),
                                s["greedy"] if temps[i] > 0 else None)
        if not active:
            continue
        order = list(active)
        forward(order, [[active[i]["out"][-1]] for i in order],
                [len(prompts[i]) + len(active[i]["out"]) - 1 for i in order])
    # feats hold f_{p-1} .. f_{L-2}: one row per output token (the last one is never fed)
    return [s for s in results if s is not None]


def shuffled(items: list, seed: int) -> list:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out
