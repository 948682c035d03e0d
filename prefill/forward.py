"""The prefill forward of a batch (docs/architecture.md, 'Life of a request'): one prompt, in
chunks of ``chunk_size`` tokens when long, or several whole prompts in one forward, each from
its first uncached token; then output position 0 of each (prefill/first_token.py), the prompt
logprobs when asked, and the seed state of each request's draft method
(``PrefillConfig.seed_states``; "hidden": the target's final hidden state at the last prompt
position; "hidden:L1,L2,...": those decoder layers' outputs there, side by side).
Each prompt runs with its request's LoRA adapter (PrefillRequest.lora_name, engine/lora.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specmesh.engine.frames import tensor_to_buffer
from specmesh.engine.grammar import GrammarCompiler
from specmesh.engine.hidden_layers import is_hidden_seed, seed_state_layers
from specmesh.engine.logprobs import token_logprobs
from specmesh.engine.lora import adapter_slot
from specmesh.engine.runner import ModelRunner
from specmesh.prefill.config import PrefillConfig
from specmesh.prefill.first_token import first_tokens
from specmesh.protocol.messages import Buffer, PrefillRequest, TokenLogprobs


def prefill_forward(runner: ModelRunner, config: PrefillConfig, paged: bool,
                    grammars: GrammarCompiler | None,
                    generator: Callable[[torch.device], torch.Generator],
                    reqs: list[PrefillRequest], tables: list[list[int]], starts: list[int]
                    ) -> tuple[list[int], list[Buffer | None],
                               list[tuple[TokenLogprobs | None, ...]],
                               list[tuple[list[int] | None, list[TokenLogprobs] | None]]]:
    """Run the prompts through ``runner``, each from ``starts[i]`` (its KV before that is
    cached; ``paged``: prefix caching is on, so chunks run paged whether cached or not, for the
    same bits), and sample output position 0 (prefill/first_token.py; ``generator`` gives the
    worker's randomness per device for unseeded requests). Returns per request its first token
    (output position 0, by its sampling mode), the seed state PrefillDone carries (None: its
    method has none), its (first token, prompt) logprobs when asked (SamplingParams.logprobs /
    prompt_logprobs) and its siblings' first tokens with their logprobs when asked
    (PrefillRequest.sibling_sampling, each by its own sampling from the same row; None: it has
    none)."""
    kinds = [config.seed_states.get(r.draft_method, "") for r in reqs]
    # hidden states once per batch: the widest layer set any request's method asks for
    hidden_kinds = sorted({k for k in kinds if is_hidden_seed(k)})
    layers = None
    if hidden_kinds:
        wanted = {seed_state_layers(k) for k in hidden_kinds}
        layers = wanted.pop() if len(wanted) == 1 else ()
    if layers == ():  # methods of one batch that want different layers: one at a time
        out = [prefill_forward(runner, config, paged, grammars, generator, reqs[i:i + 1],
                               tables[i:i + 1], starts[i:i + 1])
               for i in range(len(reqs))]
        return ([f for o in out for f in o[0]], [s for o in out for s in o[1]],
                [x for o in out for x in o[2]], [x for o in out for x in o[3]])
    want_hidden = bool(hidden_kinds)
    slots = [adapter_slot(runner.model, r.lora_name) if r.lora_name else -1
             for r in reqs]  # validated: known names
    prompts = [r.prompt_token_ids[s:] for r, s in zip(reqs, starts)]
    prompt_lps: list[TokenLogprobs | None] = [None] * len(reqs)
    if len(reqs) == 1 and reqs[0].sampling.prompt_logprobs is not None:
        out, prompt_lps[0] = prefill_with_prompt_logprobs(
            runner, config.chunk_size, reqs[0], tables[0], want_hidden, layers, paged, slots[0])
        logits, hidden = (([out[0]], [out[1]]) if want_hidden else ([out], None))
    elif len(reqs) == 1:
        out = runner.prefill(prompts[0], tables[0], chunk_size=config.chunk_size,
                             start_pos=starts[0], return_hidden=want_hidden,
                             hidden_layers=layers, paged=paged, adapter=slots[0])
        logits, hidden = (([out[0]], [out[1]]) if want_hidden else ([out], None))
    else:  # whole prompts (bounded by the batch's token budget): every row's logits only
        # when a request asks for prompt logprobs (whose prompt then starts at 0: no cache)
        rows = "all" if any(r.sampling.prompt_logprobs is not None for r in reqs) else "last"
        out = runner.prefill_batch(prompts, tables, return_hidden=want_hidden,
                                   hidden_layers=layers, start_positions=starts,
                                   paged=paged, logits=rows, adapters=slots)
        logits, hidden = out if want_hidden else (out, None)
        for i, r in enumerate(reqs):
            k = r.sampling.prompt_logprobs
            if k is not None:
                ids = r.prompt_token_ids
                prompt_lps[i] = token_logprobs(logits[i][:len(ids) - 1], ids[1:],
                                               min(k, logits[i].shape[-1]))
    last = torch.cat([x.reshape(-1, x.shape[-1])[-1:] for x in logits])
    firsts, first_lps, sibling_parts = first_tokens(last, reqs, grammars,
                                                    generator(last.device))
    seeds: list[Buffer | None] = []
    for i, kind in enumerate(kinds):  # EAGLE family: f_{p-1}, the state that predicted 0
        seeds.append(tensor_to_buffer(hidden[i][-1:].clone()) if is_hidden_seed(kind)
                     else None)
    return firsts, seeds, list(zip(first_lps, prompt_lps)), sibling_parts


def prefill_with_prompt_logprobs(runner: ModelRunner, chunk_size: int, req: PrefillRequest,
                                 table: list[int], want_hidden: bool, layers,  # noqa: ANN001
                                 paged: bool, adapter: int = -1):
    """Run ``req``'s whole prompt chunk by chunk as ``runner.prefill`` does, taking each
    chunk's logprobs from its logits before the next (a long prompt never holds every
    row's logits at once). Returns what ``runner.prefill`` returns (the last row's logits,
    with the hidden states when asked) and the prompt's logprobs: row i predicts prompt
    token i + 1, the float32 log_softmax of the raw logits (engine/logprobs.py), as the
    verifier reports the output's; position 0 has none (OpenAI and vLLM report None)."""
    ids = req.prompt_token_ids
    step = chunk_size or len(ids)
    parts: list[TokenLogprobs] = []
    hiddens: list[torch.Tensor] = []
    last = None
    for lo in range(0, len(ids), step):
        out = runner.prefill(ids[lo:lo + step], table, start_pos=lo,
                             return_hidden=want_hidden, hidden_layers=layers,
                             paged=paged, logits="all", adapter=adapter)
        rows, hidden = out if want_hidden else (out, None)
        if hidden is not None:
            hiddens.append(hidden)
        targets = ids[lo + 1:lo + 1 + rows.shape[0]]  # the last row predicts the output
        parts.append(token_logprobs(rows[:len(targets)], targets,
                                    min(req.sampling.prompt_logprobs, rows.shape[-1])))
        last = rows[-1:]
    prompt_lp = TokenLogprobs.concat(parts)
    return ((last, torch.cat(hiddens)) if want_hidden else last), prompt_lp
