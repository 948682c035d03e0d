"""``specmesh train-drafter --method dflash``: after the shared steps of drafter/training/eagle.py
(target loaded, prompts split, the target's greedy outputs generated with the hidden states of
``--feature-layers``, e.g. ``auto``; none: the final-norm state), build a DFlash draft of
``--num-layers`` layers (default 1, started from the target's first layers) for blocks of
``--block`` drafts (default 4) scoring the ``--draft-vocab-size`` most frequent output tokens
(0: the whole vocabulary), train it on the block objective (drafter/dflash_training.py;
stopped after ``--train-minutes`` when given), evaluate acceptance per draft position with the
serving proposer on the held-out prompts and every ``--eval-prompts`` file, and write the
checkpoint (drafter/dflash_files.py; ``--save-dtype bfloat16`` halves it).
``--drafter dflash:OUT`` drafts with it.
"""

from __future__ import annotations

import argparse

import torch

from specmesh.drafter.eagle.checkpoint import round_weights, target_identity
from specmesh.drafter.eagle.train import acceptance_report, draft_vocabulary
from specmesh.drafter.training.record import training_record

DEFAULT_NUM_LAYERS = 1
DEFAULT_BLOCK = 4


def train_dflash(prep: dict, args: argparse.Namespace, proposer_cls: type) -> dict:
    """Train, evaluate with ``proposer_cls`` (drafter/proposers/dflash.py's DFlashProposer,
    passed by its module, which imports this one) and save; returns the evaluation (also in
    the checkpoint's config)."""
    # the training loop (tqdm, the objective) and the model only when training
    from specmesh.drafter.dflash_files import save_dflash
    from specmesh.drafter.dflash_config import DFlashConfig
    from specmesh.drafter.dflash_model import DFlashDraft
    from specmesh.drafter.dflash_training import DEFAULT_GAMMA, acceptance, init_for_training, train

    lm, samples = prep["lm"], prep["samples"]
    embed = lm.model.model.embed_tokens.weight.detach()
    lm_head = lm.model.lm_head.weight.detach()
    num_layers = args.num_layers or DEFAULT_NUM_LAYERS
    block = getattr(args, "block", None) or DEFAULT_BLOCK
    vocab = lm.config.vocab_size
    n_draft = args.draft_vocab_size if 0 < args.draft_vocab_size < vocab else 0
    cfg = DFlashConfig.for_target(lm.config, num_layers=num_layers, block=block,
                                  feature_layers=args.resolved_feature_layers,
                                  target=target_identity(lm.name, lm.config, embed),
                                  draft_vocab_size=n_draft,
                                  anchor_input=getattr(args, "anchor_input", "on") == "on",
                                  feature_norms=True,
                                  max_run_ahead=getattr(args, "max_run_ahead", None))
    torch.manual_seed(args.seed)
    draft = DFlashDraft(cfg)
    if n_draft:  # the most frequent output tokens score (the LM head is the forward's cost)
        draft.set_draft_vocabulary(draft_vocabulary(samples["train"], n_draft,
                                                    tuple(lm.config.eos_token_ids)))
    draft.set_target_weights(embed.float(), lm_head.float())
    init_for_training(draft, list(lm.model.model.layers[:num_layers]))
    print(f"DFlash draft ({cfg.seed_state}): {num_layers} layers, "
          f"{draft.num_own_parameters() / 1e6:.2f} M parameters besides the target's embedding "
          f"and LM head ({cfg.num_draft_logits} of its rows scored); block {block}; "
          f"{sum(s.num_output_tokens for s in samples['train'])} training tokens", flush=True)
    minutes = getattr(args, "train_minutes", None)
    summary = train(draft, samples["train"], epochs=args.epochs, batch_size=args.batch_size,
                    lr=args.lr, seed=args.seed, max_seconds=minutes * 60 if minutes else None,
                    gamma=getattr(args, "gamma", None) or DEFAULT_GAMMA,
                    autocast_dtype=None if args.autocast == "none"
                    else getattr(torch, args.autocast))
    save_dtype = getattr(torch, args.save_dtype)
    round_weights(draft, save_dtype)  # evaluate what the checkpoint will hold
    evaluator = proposer_cls(draft)
    evaluation = {}
    for label, ss in samples.items():
        if label == "train" or not ss:
            continue
        acc = acceptance(evaluator, ss, block)
        evaluation[label] = {"prompts": len(ss), "acceptance_per_position": acc,
                             "mean_accepted_per_chain": sum(acc)}
        print(f"{label} ({len(ss)} prompts): {acceptance_report(acc)}", flush=True)
    sizes = {"block_forwards": evaluator.stats.num_block_forwards,
             "draft_weights_bytes_saved": sum(p.numel() for p in draft.parameters())
             * torch.empty(0, dtype=save_dtype).element_size()}
    training = training_record(prep, args, {**summary, **sizes}, evaluation)
    out = save_dflash(draft, args.out, training, dtype=save_dtype)
    print(f"wrote {out} in {training['total_seconds'] / 60:.1f} min total "
          f"(--drafter dflash:{out})", flush=True)
    return evaluation
