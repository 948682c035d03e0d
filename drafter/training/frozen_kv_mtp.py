"""``specmesh train-drafter --method frozen-kv-mtp``: after the shared steps of
drafter/training/eagle.py (target loaded, prompts split, the target's greedy outputs generated
and cached in ``--data``), run the target once over every sample for its final hidden states
and the K/V of the assistant's target layer (``--target-layer``, default the last), start the
assistant from that layer (drafter/frozen_kv/assistant.py ``init_from_target``), train it
(drafter/frozen_kv/train.py; ``--train-minutes`` bounds the run), evaluate per-position
acceptance of its own chains on every held-out set, and write the checkpoint
(drafter/frozen_kv/checkpoint.py) whose config.json records the numbers and the command.
``--drafter frozen-kv-mtp:OUT`` drafts with it.
"""

from __future__ import annotations

import argparse

import torch

from specmesh.drafter.eagle.checkpoint import round_weights, target_identity
from specmesh.drafter.eagle.train import acceptance_report, draft_vocabulary
from specmesh.drafter.frozen_kv.assistant import AssistantConfig, FrozenKVAssistant
from specmesh.drafter.frozen_kv.checkpoint import save_assistant
from specmesh.drafter.frozen_kv.train import acceptance, target_sequences, train
from specmesh.drafter.training.record import training_record
from specmesh.engine.model import rope_inv_freq


def train_frozen_kv_mtp(prep: dict, args: argparse.Namespace) -> dict:
    """Train, evaluate and save an assistant on the prepared samples; returns the evaluation
    (also in the checkpoint's config.json).

    Raises:
        SystemExit: a ``--target-layer`` the target does not have.
    """
    lm, samples = prep["lm"], prep["samples"]
    config = lm.config
    embed = lm.model.model.embed_tokens.weight.detach()
    lm_head = lm.model.lm_head.weight.detach()
    vocab = config.vocab_size
    n_draft = args.draft_vocab_size if 0 < args.draft_vocab_size < vocab else 0
    layer = getattr(args, "target_layer", None)
    try:
        cfg = AssistantConfig.for_target(config, draft_vocab_size=n_draft, target_layer=layer,
                                         target=target_identity(lm.name, config, embed))
    except ValueError as err:
        raise SystemExit(f"--target-layer: {err}") from None
    torch.manual_seed(args.seed)
    model = FrozenKVAssistant(cfg, rope_inv_freq(config))
    model.init_from_target(lm.model.model.layers[cfg.target_layer],
                           lm.model.model.norm.weight.detach().float())
    ids = (draft_vocabulary(samples["train"], n_draft, tuple(config.eos_token_ids))
           if n_draft else None)
    model.set_target_weights(embed.float(), lm_head.float(), ids)
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[model.draft_to_target] = torch.arange(model.draft_to_target.numel())
    seqs = {label: target_sequences(lm, ss, cfg.target_layer)
            for label, ss in samples.items() if ss}
    train_seqs = seqs["train"]
    print(f"frozen-kv-mtp: reads target layer {cfg.target_layer}, "
          f"{model.num_trainable_parameters() / 1e6:.2f} M parameters, draft vocabulary "
          f"{model.lm_head.shape[0]}, {sum(s.anchors.numel() for s in train_seqs)} training "
          f"anchors", flush=True)

    def progress(step: int, loss: float) -> None:
        if step % 20 == 0:
            print(f"  step {step}: loss {loss:.3f}", flush=True)

    summary = train(model, train_seqs, epochs=args.epochs, batch_size=args.batch_size,
                    lr=args.lr, depth=args.depth, to_draft=to_draft,
                    reg_weight=args.reg_weight if args.reg_weight is not None else 0.5,
                    seed=args.seed, max_minutes=args.train_minutes, progress=progress)
    save_dtype = getattr(torch, args.save_dtype)
    round_weights(model, save_dtype)  # evaluate what the checkpoint will hold
    evaluation = {}
    for label, ss in seqs.items():
        if label == "train":
            continue
        acc = acceptance(model, ss, args.eval_depth)
        evaluation[label] = {"prompts": len(ss), "acceptance_per_position": acc,
                             "mean_accepted_per_chain": sum(acc)}
        print(f"{label} ({len(ss)} prompts): {acceptance_report(acc)}", flush=True)
    if not evaluation:  # no held-out split: the training rows', said so in the record
        acc = acceptance(model, train_seqs, args.eval_depth)
        evaluation["train"] = {"prompts": len(train_seqs), "acceptance_per_position": acc,
                               "mean_accepted_per_chain": sum(acc)}
        print(f"train ({len(train_seqs)} prompts, no held-out split): "
              f"{acceptance_report(acc)}", flush=True)
    training = training_record(prep, args, summary, evaluation)
    out = save_assistant(model, args.out, training, dtype=save_dtype)
    print(f"wrote {out} in {training['total_seconds'] / 60:.1f} min total "
          f"(--drafter frozen-kv-mtp:{out})", flush=True)
    return evaluation
