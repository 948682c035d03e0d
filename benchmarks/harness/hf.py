"""The Hugging Face baselines of ``specmesh bench``: batched greedy ``generate`` (left padding,
attention mask) and, one prompt at a time, ``generate`` with prompt lookup (transformers does
not batch prompt lookup). Both run in the bench's own process on its own model copy."""

from __future__ import annotations

import time
from typing import Any

from specmesh.gateway.tokens import chat_prompt_ids
from specmesh.cluster.runs import RunResult


def load_hf_model(model: str | None = None, dtype: str = "float32") -> Any:
    """The transformers model (eval) with the weights specmesh serves for ``model``: the
    Hugging Face baseline of the bench (and the reference of the exactness tests)."""
    from transformers import AutoModelForCausalLM

    from specmesh.engine.dtypes import model_dtype
    from specmesh.engine.loader import model_files

    path = model_files(model, dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(dtype)).eval()


def generation_eos_ids(hf_model) -> list[int]:
    """The end-of-sequence ids of the model's generation config (a list, maybe empty)."""
    eos = hf_model.generation_config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def cut_at_eos(token_ids: list[int], eos_ids: list[int]) -> list[int]:
    """``token_ids`` up to and including the first end-of-sequence id (what specmesh emits:
    nothing past the end)."""
    for i, t in enumerate(token_ids):
        if t in eos_ids:
            return token_ids[: i + 1]
    return token_ids


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Left-pad token id lists to one length: (input ids, attention mask with 0 on pads)."""
    n = max(len(ids) for ids in batch)
    ids = [[pad_id] * (n - len(x)) + list(x) for x in batch]
    mask = [[0] * (n - len(x)) + [1] * len(x) for x in batch]
    return ids, mask


def run_hf(hf_model, tokenizer, prompts: list[dict], max_tokens: int, system: str,
           eos_ids: list[int], batch_size: int = 1,
           prompt_lookup: int | None = None) -> RunResult:
    """Greedy Hugging Face ``generate`` over ``prompts`` in batches of ``batch_size`` (left
    padding and an attention mask); with ``prompt_lookup`` (draft tokens per step) one prompt
    at a time. Completion tokens count up to and including the first EOS; ``seconds`` is the
    wall time of all batches.

    Raises:
        ValueError: ``prompt_lookup`` with ``batch_size`` > 1.
    """
    import torch

    if prompt_lookup and batch_size > 1:
        raise ValueError("transformers' prompt lookup decoding runs one prompt at a time")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        eos_ids[0] if eos_ids else 0)
    res = RunResult(system, token_ids=[], concurrency=batch_size)
    kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    all_ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in prompts]
    t0 = time.perf_counter()
    for start in range(0, len(all_ids), batch_size):
        ids, mask = left_pad(all_ids[start:start + batch_size], pad_id)
        ids_t = torch.tensor(ids)
        with torch.inference_mode():
            out = hf_model.generate(ids_t, attention_mask=torch.tensor(mask), do_sample=False,
                                    max_new_tokens=max_tokens, eos_token_id=eos_ids or None,
                                    pad_token_id=pad_id, temperature=None, top_p=None,
                                    top_k=None, **kw)
        for row in out[:, ids_t.shape[1]:].tolist():
            new = cut_at_eos(row, eos_ids)
            res.token_ids.append(new)
            res.num_tokens += len(new)
    res.seconds = time.perf_counter() - t0
    res.texts = [tokenizer.decode(t, skip_special_tokens=True) for t in res.token_ids]
    return res
