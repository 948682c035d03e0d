"""``specmesh train-drafter --method draft-model``: after the shared steps of
drafter/training/eagle.py (target loaded, prompts split, samples generated), build the draft
model from the target, distil it (drafter/draft_model_training.py, progress bar with loss and
tokens/s), evaluate acceptance per draft position on the held-out prompts and every
``--eval-prompts`` file, and write it as a Hugging Face dir (config.json, model.safetensors,
the target's tokenizer) with ``specmesh_draft.json`` naming the target, the command and the
numbers. ``--drafter draft-model:OUT`` drafts with it.
"""

from __future__ import annotations

import argparse

import torch

from specmesh.drafter.draft_model_files import engine_model, save_draft_model
from specmesh.drafter.eagle.checkpoint import target_identity
from specmesh.drafter.eagle.train import acceptance_report
from specmesh.drafter.training.record import training_record

DEFAULT_NUM_LAYERS = 2


def train_draft_model(prep: dict, args: argparse.Namespace) -> dict:
    """Train, evaluate and save; returns the evaluation (also in specmesh_draft.json)."""
    # the engine's runner (triton kernels) only when training
    from specmesh.drafter.draft_model_training import acceptance, init_draft_model, train

    lm, samples = prep["lm"], prep["samples"]
    num_layers = args.num_layers or DEFAULT_NUM_LAYERS
    draft, sources = init_draft_model(lm.model, lm.hf_config, num_layers, args.init_layers,
                                      seed=args.seed)
    lm_head = lm.model.lm_head.weight.detach()
    n_params = sum(p.numel() for p in draft.model.layers.parameters())
    print(f"draft model: {num_layers} layers ({n_params / 1e6:.2f} M parameters besides "
          f"embedding and LM head), initialised from "
          f"{'target layers ' + str(sources) if sources else 'random layers'}; "
          f"{sum(s.num_output_tokens for s in samples['train'])} training tokens", flush=True)
    summary = train(draft, samples["train"], lm_head, epochs=args.epochs,
                    batch_size=args.batch_size, lr=args.lr,
                    kl_weight=args.kl_weight, seed=args.seed,
                    train_embeddings=args.train_embeddings)
    evaluator = engine_model(draft)
    evaluation = {}
    for label, ss in samples.items():
        if label == "train" or not ss:
            continue
        acc = acceptance(evaluator, evaluator.config, ss, args.eval_depth)
        evaluation[label] = {"prompts": len(ss), "acceptance_per_position": acc,
                             "mean_accepted_per_chain": sum(acc)}
        print(f"{label} ({len(ss)} prompts): {acceptance_report(acc)}", flush=True)
    training = training_record(prep, args, summary, evaluation)
    meta = {"target": target_identity(lm.name, lm.config,
                                      lm.model.model.embed_tokens.weight.detach()),
            "num_layers": num_layers, "init_layers": args.init_layers,
            "layers_from_target": sources, "kl_weight": args.kl_weight,
            "train_embeddings": args.train_embeddings, "training": training}
    with torch.no_grad():
        out = save_draft_model(draft, lm.tokenizer, args.out, meta, target_path=lm.path)
    print(f"wrote {out} in {training['total_seconds'] / 60:.1f} min total "
          f"(--drafter draft-model:{out})", flush=True)
    return evaluation
