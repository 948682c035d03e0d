"""``specmesh train-drafter --method dspark``: after the shared steps of drafter/training/eagle.py
(target loaded, prompts split, the target's greedy outputs generated), build the backbone, a
PARD draft: from a trained PARD checkpoint (``--dspark-backbone DIR``: its layers, mask vector,
mask id and block) or, as ``--method pard`` does, from the target's first ``--num-layers``
layers; add the Markov head (``--markov vanilla|gated|rnn``, ``--markov-rank`` r > 0) and the
confidence head; train them (drafter/dspark_training.py: PARD's objective on the corrected
logits plus ``--confidence-weight`` x BCE of the confidence head; the backbone too unless
``--dspark-freeze-backbone``; stopped after ``--train-minutes`` when given); evaluate
acceptance per draft position and the confidence head's calibration with the serving proposer
on the held-out prompts and every ``--eval-prompts`` file; write the checkpoint
(drafter/dspark_files.py; ``--save-dtype bfloat16`` halves it). ``--drafter dspark:OUT``
drafts with it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specmesh.drafter.dspark_markov import MARKOV_KINDS

DEFAULT_MARKOV = "gated"
DEFAULT_RANK = 32


def add_dspark_options(p: argparse.ArgumentParser) -> None:
    """The ``train-drafter`` flags of ``--method dspark``."""
    p.add_argument("--markov", choices=MARKOV_KINDS, default=DEFAULT_MARKOV,
                   help="dspark: the Markov head's shape (each draft's logits biased by the "
                        "draft before it)")
    p.add_argument("--markov-rank", type=int, default=DEFAULT_RANK,
                   help="dspark: rank r of the Markov correction (positive: rank 0 is pard)")
    p.add_argument("--confidence-weight", type=float, default=1.0,
                   help="dspark: weight of the confidence head's BCE in the loss")
    p.add_argument("--dspark-backbone", default=None,
                   help="dspark: a PARD checkpoint to start the block backbone from (its "
                        "block and mask id are kept); default: the target's first layers")
    p.add_argument("--dspark-freeze-backbone", action="store_true",
                   help="dspark: train the Markov and confidence heads only")


def _backbone(lm, args: argparse.Namespace, samples: list) -> tuple:  # noqa: ANN001
    """(draft, layer sources, mask id, block, mask vector or None) of the backbone."""
    from safetensors.torch import load_file  # safetensors only when a checkpoint is read

    from specmesh.drafter.draft_model_training import init_draft_model  # transformers
    from specmesh.drafter.eagle.checkpoint import check_target, target_identity
    from specmesh.drafter.pard_files import WEIGHTS, read_pard_config
    from specmesh.drafter.pard_training import choose_mask_token

    path = getattr(args, "dspark_backbone", None)
    if path is None:
        num_layers = args.num_layers or 2
        draft, sources = init_draft_model(lm.model, lm.hf_config, num_layers, "first",
                                          seed=args.seed)
        mask_id = choose_mask_token(lm.tokenizer, samples, lm.config.vocab_size)
        return draft, sources, mask_id, getattr(args, "block", None) or 4, None
    meta = read_pard_config(path)
    check_target(meta["target"], target_identity(
        lm.name, lm.config, lm.model.model.embed_tokens.weight.detach()), str(path))
    draft, _ = init_draft_model(lm.model, lm.hf_config, int(meta["num_layers"]), "first",
                                seed=args.seed)
    tensors = {k: v.float() for k, v in load_file(str(Path(path) / WEIGHTS)).items()}
    mask_vec = tensors.pop("mask_embedding")
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if unexpected or any(k.startswith(("model.layers.", "model.norm.")) for k in missing):
        raise SystemExit(f"--dspark-backbone {path}: weights do not fit a "
                         f"{meta['num_layers']}-layer draft ({unexpected or missing})")
    block = getattr(args, "block", None) or int(meta["block"])
    return (draft, meta.get("layers_from_target", list(range(int(meta["num_layers"])))),
            int(meta["mask_token_id"]), block, mask_vec)


def train_dspark(prep: dict, args: argparse.Namespace, proposer_cls: type) -> dict:
    """Train, evaluate with ``proposer_cls`` (drafter/proposers/dspark.py's DSparkProposer,
    passed by its module, which imports this one) and save; returns the evaluation (also in
    the checkpoint's config)."""
    # the engine's runner and model (compiled kernels) and transformers only when training
    from specmesh.drafter.dspark_files import save_dspark
    from specmesh.drafter.dspark_markov import MarkovHead, check_markov
    from specmesh.drafter.dspark_training import evaluate, train
    from specmesh.drafter.eagle.checkpoint import target_identity
    from specmesh.drafter.eagle.train import acceptance_report
    from specmesh.drafter.pard_training import serving_state
    from specmesh.drafter.training.record import training_record
    from specmesh.engine.config import ModelConfig
    from specmesh.engine.loader import build_model

    kind = getattr(args, "markov", DEFAULT_MARKOV)
    rank = getattr(args, "markov_rank", DEFAULT_RANK)
    try:
        check_markov(kind, rank)
    except ValueError as err:
        raise SystemExit(f"--method dspark: {err}") from None
    lm, samples = prep["lm"], prep["samples"]
    every = [s for ss in samples.values() for s in ss]
    draft, sources, mask_id, block, mask_vec = _backbone(lm, args, every)
    if any(mask_id in s.token_ids for s in every):
        raise SystemExit(f"the backbone's mask token {mask_id} occurs in the samples")
    hidden, vocab = lm.config.hidden_size, lm.config.vocab_size
    torch.manual_seed(args.seed)
    head = MarkovHead(kind, hidden, rank, vocab)
    train_backbone = not getattr(args, "dspark_freeze_backbone", False)
    origin = getattr(args, "dspark_backbone", None) or f"target layers {sources}"
    head_m = sum(p.numel() for p in head.parameters()) / 1e6
    print(f"DSpark draft: {len(sources)} layers from {origin}, block {block}, mask token "
          f"{mask_id}; {kind} Markov head of rank {rank} ({head_m:.2f} M parameters); "
          f"backbone {'trained' if train_backbone else 'frozen'}; "
          f"{sum(s.num_output_tokens for s in samples['train'])} training tokens", flush=True)
    minutes = getattr(args, "train_minutes", None)
    mask_vec, summary = train(
        draft, head, samples["train"], mask_token_id=mask_id, block=block, epochs=args.epochs,
        batch_size=args.batch_size, lr=args.lr, mask_embedding=mask_vec,
        train_backbone=train_backbone,
        confidence_weight=getattr(args, "confidence_weight", 1.0), seed=args.seed,
        cod_ratio=getattr(args, "cod_ratio", 0.7),
        max_seconds=minutes * 60 if minutes else None,
        autocast_dtype=None if args.autocast == "none" else getattr(torch, args.autocast))
    save_dtype = getattr(torch, args.save_dtype)
    # evaluate what the checkpoint will hold (weights rounded to the saved dtype)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith(("model.layers.", "model.norm.")):
                p.copy_(p.to(save_dtype).float())
        for p in head.parameters():
            p.copy_(p.to(save_dtype).float())
        mask_vec = mask_vec.to(save_dtype).float()
    config = ModelConfig.from_hf(draft.config)
    evaluator = proposer_cls(build_model(config, serving_state(draft, mask_vec, mask_id),
                                         torch.float32),
                             config, head, mask_id, block, num_blocks=4096)
    evaluation = {}
    for label, ss in samples.items():
        if label == "train" or not ss:
            continue
        ev = evaluate(evaluator, ss, block)
        acc = ev["acceptance_per_position"]
        evaluation[label] = {"prompts": len(ss), "acceptance_per_position": acc,
                             "mean_accepted_per_chain": sum(acc),
                             "confidence_calibration": ev["calibration"]}
        cal = ev["calibration"]
        print(f"{label} ({len(ss)} prompts): {acceptance_report(acc)}; confidence head: "
              f"predicted {cal['mean_predicted']:.3f} vs realised {cal['mean_realised']:.3f} "
              f"survival over {cal['judged']} judged drafts (Brier {cal['brier']:.3f})",
              flush=True)
    stats = {"block_forwards": evaluator.stats.num_block_forwards}
    training = training_record(prep, args, {**summary, **stats}, evaluation)
    meta = {"num_layers": config.num_layers, "mask_token_id": mask_id, "block": block,
            "layers_from_target": sources,
            "target": target_identity(lm.name, lm.config,
                                      lm.model.model.embed_tokens.weight.detach()),
            "training": training}
    out = save_dspark(draft.state_dict(), mask_vec, head, args.out, meta, dtype=save_dtype)
    print(f"wrote {out} in {training['total_seconds'] / 60:.1f} min total "
          f"(--drafter dspark:{out})", flush=True)
    return evaluation
