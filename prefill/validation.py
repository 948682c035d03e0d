"""Whether a PrefillRequest can be prefilled by this worker: a bad request gets a failed
PrefillDone with the reason (the verifier turns it into the request's error) and never reaches
the forward, so no prompt can kill the role."""

from __future__ import annotations

from specmesh.engine.block_manager import BlockManager
from specmesh.engine.config import ModelConfig
from specmesh.engine.grammar import GrammarCompiler
from specmesh.protocol.messages import PrefillRequest


def invalid_reason(req: PrefillRequest, model_config: ModelConfig, block_manager: BlockManager,
                   grammars: GrammarCompiler | None,
                   lora_names: frozenset[str] | set[str] = frozenset()) -> str:
    """Why ``req`` cannot be prefilled ("" when it can): an empty prompt, one longer than the
    model's ``max_position_embeddings`` or than this worker's whole KV cache, a token id
    outside the vocabulary, bad sampling parameters (its own or a sibling's), a grammar that
    does not compile, no destination blocks, or a LoRA adapter not among ``lora_names``
    (those this worker loaded)."""
    n = len(req.prompt_token_ids)
    if req.lora_name and req.lora_name not in lora_names:
        return f"LoRA adapter {req.lora_name!r} is not loaded on this prefill worker"
    cfg = model_config
    if n == 0:
        return "empty prompt"
    if n > cfg.max_position_embeddings:
        return (f"prompt of {n} tokens exceeds max_position_embeddings "
                f"{cfg.max_position_embeddings}")
    if any(t < 0 or t >= cfg.vocab_size for t in req.prompt_token_ids):
        return f"prompt token id outside [0, {cfg.vocab_size})"
    for sampling in [req.sampling] + list(req.sibling_sampling or []):
        why = sampling.invalid_reason() or sampling.vocab_reason(cfg.vocab_size)
        if why:
            return why
    why = grammar_reason(req, grammars)
    if why:
        return why
    if not req.block_table:
        return "no destination blocks"
    if block_manager.blocks_for(n) > block_manager.num_blocks:
        return f"prompt of {n} tokens does not fit this prefill worker's KV cache"
    return ""


def grammar_reason(req: PrefillRequest, grammars: GrammarCompiler | None) -> str:
    """Why ``req``'s grammar cannot mask its first token ("" when it can, or it has
    none); compiling it here caches it in ``grammars`` for the forward."""
    spec = req.sampling.grammar
    if spec is None:
        return ""
    if grammars is None:
        return "structured output needs the model's tokenizer on the prefill worker"
    try:
        grammars.matcher(spec)
    except ValueError as err:
        return f"grammar: {err}"
    return ""
