"""``specmesh train-drafter --method pard``: after the shared steps of drafter/training/eagle.py
(target loaded, prompts split, the target's greedy outputs generated), build the draft from
the target's first ``--num-layers`` layers (default 2), pick the mask token id, train it on
the mask-block objective (drafter/pard_training.py: ``--block`` drafts per forward, COD
``--cod-ratio``, stopped after ``--train-minutes`` when given), evaluate acceptance per draft
position with the serving proposer on the held-out prompts and every ``--eval-prompts`` file,
and write the checkpoint (drafter/pard_files.py; ``--save-dtype bfloat16`` halves it).
``--drafter pard:OUT`` drafts with it.
"""

from __future__ import annotations

import argparse

import torch

from specmesh.drafter.eagle.checkpoint import target_identity
from specmesh.drafter.eagle.train import acceptance_report
from specmesh.drafter.pard_files import save_pard
from specmesh.drafter.training.record import training_record

DEFAULT_NUM_LAYERS = 2
DEFAULT_BLOCK = 4


def train_pard(prep: dict, args: argparse.Namespace, proposer_cls: type) -> dict:
    """Train, evaluate with ``proposer_cls`` (drafter/proposers/pard.py's PardProposer, passed
    by its module, which imports this one) and save; returns the evaluation (also in the
    checkpoint's config)."""
    # the engine's runner and model (compiled kernels) and transformers only when training
    from specmesh.drafter.draft_model_training import init_draft_model
    from specmesh.drafter.pard_training import (
        acceptance,
        choose_mask_token,
        serving_state,
        train,
    )
    from specmesh.engine.config import ModelConfig
    from specmesh.engine.loader import build_model

    lm, samples = prep["lm"], prep["samples"]
    num_layers = args.num_layers or DEFAULT_NUM_LAYERS
    block = getattr(args, "block", None) or DEFAULT_BLOCK
    draft, sources = init_draft_model(lm.model, lm.hf_config, num_layers, "first",
                                      seed=args.seed)
    every = [s for ss in samples.values() for s in ss]
    mask_id = choose_mask_token(lm.tokenizer, every, lm.config.vocab_size)
    n_params = sum(p.numel() for p in draft.model.layers.parameters())
    print(f"PARD draft: {num_layers} layers ({n_params / 1e6:.2f} M parameters besides "
          f"embedding and LM head) from target layers {sources}; block {block}, mask token "
          f"{mask_id}; {sum(s.num_output_tokens for s in samples['train'])} training tokens",
          flush=True)
    minutes = getattr(args, "train_minutes", None)
    mask_vec, summary = train(
        draft, samples["train"], mask_token_id=mask_id, block=block, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        cod_ratio=getattr(args, "cod_ratio", 0.7),
        max_seconds=minutes * 60 if minutes else None,
        autocast_dtype=None if args.autocast == "none" else getattr(torch, args.autocast))
    save_dtype = getattr(torch, args.save_dtype)
    # evaluate what the checkpoint will hold (weights rounded to the saved dtype)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith(("model.layers.", "model.norm.")):
                p.copy_(p.to(save_dtype).float())
        mask_vec = mask_vec.to(save_dtype).float()
    config = ModelConfig.from_hf(draft.config)
    evaluator = proposer_cls(build_model(config, serving_state(draft, mask_vec, mask_id),
                                         torch.float32),
                             config, mask_id, block, num_blocks=4096)
    evaluation = {}
    for label, ss in samples.items():
        if label == "train" or not ss:
            continue
        acc = acceptance(evaluator, ss, block)
        evaluation[label] = {"prompts": len(ss), "acceptance_per_position": acc,
                             "mean_accepted_per_chain": sum(acc)}
        print(f"{label} ({len(ss)} prompts): {acceptance_report(acc)}", flush=True)
    evaluation_stats = {"block_forwards": evaluator.stats.num_block_forwards}
    training = training_record(prep, args, {**summary, **evaluation_stats}, evaluation)
    meta = {"num_layers": num_layers, "mask_token_id": mask_id, "block": block,
            "layers_from_target": sources,
            "target": target_identity(lm.name, lm.config,
                                      lm.model.model.embed_tokens.weight.detach()),
            "training": training}
    out = save_pard(draft.state_dict(), mask_vec, args.out, meta, dtype=save_dtype)
    print(f"wrote {out} in {training['total_seconds'] / 60:.1f} min total "
          f"(--drafter pard:{out})", flush=True)
    return evaluation
