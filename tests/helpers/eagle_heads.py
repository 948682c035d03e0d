"""An untrained EAGLE head for a test target, saved as a checkpoint (``--drafter eagle:PATH``):
its drafts are mostly wrong, which is what exactness tests want."""

from __future__ import annotations

from pathlib import Path


def save_random_head(model_dir: str, path: str | Path, seed: int = 0) -> str:
    """Write a randomly initialised head of ``model_dir``'s layer shape, naming that target,
    to ``path``; returns the checkpoint directory."""
    import torch
    from transformers import AutoConfig

    from specmesh.drafter.eagle.checkpoint import save_head, target_embeddings, target_identity
    from specmesh.drafter.eagle.head import EagleHead, EagleHeadConfig
    from specmesh.engine.config import ModelConfig
    from specmesh.engine.loader import model_identity

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    embed, _ = target_embeddings(model_dir)
    name = model_identity(model_dir, "float32", 16)["name"]
    torch.manual_seed(seed)
    head = EagleHead(EagleHeadConfig.for_target(config,
                                                target=target_identity(name, config, embed)))
    return str(save_head(head, path))


def assert_eagle_equals_plain_decode(lm, head, messages: list, kappa: int = 3,  # noqa: ANN001
                                     max_tokens: int = 24) -> None:
    """Greedy output of the in-process workers drafting with ``head`` (an EagleHead for the
    loaded target ``lm``) equals plain decoding on the first six of ``messages``, and drafts
    were made and accepted."""
    from specmesh.cluster.inprocess import InProcessCluster
    from specmesh.drafter.eagle.data import chat_token_ids
    from specmesh.drafter.proposers.eagle import EagleProposer
    from specmesh.protocol.messages import SamplingParams

    prompts = chat_token_ids(lm.tokenizer, [{"messages": m} for m in messages[:6]])
    sp = SamplingParams(max_tokens=max_tokens)
    eos = lm.config.eos_token_ids
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=eos).generate(prompts, sp)
    spec = InProcessCluster(lm.model, lm.config, num_speculative_tokens=kappa,
                            eos_token_ids=eos, draft_method="eagle",
                            proposer=EagleProposer(head_module=head)).generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.spec.num_draft_tokens for o in spec) > 0
    assert sum(o.spec.num_accepted_tokens for o in spec) > 0
