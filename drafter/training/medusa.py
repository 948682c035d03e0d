"""``specmesh train-drafter --method medusa``: after the shared steps of
drafter/training/eagle.py (target loaded, prompts split, the target's greedy outputs generated
with its final hidden states, cached in ``--data``), pick the draft vocabulary, train K Medusa
heads on the precomputed states (drafter/medusa/train.py; the target never runs again), choose
the static tree from the held-out split's per-head accuracy (drafter/medusa/tree.py), evaluate
every held-out set, and write the checkpoint (drafter/medusa/checkpoint.py) whose config.json
records the tree, the numbers and the command. ``--drafter medusa:OUT`` drafts with it.
"""

from __future__ import annotations

import argparse

import torch

from specmesh.drafter.eagle.checkpoint import round_weights, target_identity
from specmesh.drafter.eagle.train import draft_vocabulary
from specmesh.drafter.medusa.checkpoint import save_heads
from specmesh.drafter.medusa.heads import MedusaConfig, MedusaHeads
from specmesh.drafter.medusa.train import evaluate, head_rows, rank_accuracy, report, train_heads
from specmesh.drafter.medusa.train import label_ranks
from specmesh.drafter.medusa.tree import choose_tree
from specmesh.drafter.training.record import training_record

#: candidates per head the tree is chosen among (Medusa's trees draw from the top 10)
TREE_TOPK = 10


def train_medusa_heads(prep: dict, args: argparse.Namespace) -> dict:
    """Train, choose the tree, evaluate and save; returns the evaluation (also in the
    checkpoint's config.json).

    Raises:
        SystemExit: fewer than 1 head or tree node.
    """
    lm, samples = prep["lm"], prep["samples"]
    if args.num_heads < 1 or args.tree_nodes < 1:
        raise SystemExit("--num-heads and --tree-nodes must be >= 1")
    embed = lm.model.model.embed_tokens.weight.detach()
    lm_head = lm.model.lm_head.weight.detach().float()
    vocab = lm.config.vocab_size
    n_draft = args.draft_vocab_size if 0 < args.draft_vocab_size < vocab else 0
    ids = (draft_vocabulary(samples["train"], n_draft, tuple(lm.config.eos_token_ids))
           if n_draft else None)
    cfg = MedusaConfig(hidden_size=lm.config.hidden_size, vocab_size=vocab,
                       num_heads=args.num_heads, draft_vocab_size=n_draft,
                       target=target_identity(lm.name, lm.config, embed))
    torch.manual_seed(args.seed)
    heads = MedusaHeads(cfg)
    heads.set_target_weights(lm_head, ids)
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[heads.draft_to_target] = torch.arange(heads.draft_to_target.numel())
    x, y = head_rows(samples["train"], to_draft, cfg.num_heads)
    print(f"medusa: {cfg.num_heads} heads, {heads.num_trainable_parameters() / 1e6:.2f} M "
          f"parameters, draft vocabulary {heads.lm_head.shape[0]}, {x.shape[0]} training "
          f"rows", flush=True)
    summary = train_heads(heads, x, y, epochs=args.epochs, batch_rows=args.batch_rows,
                          lr=args.lr, seed=args.seed,
                          autocast_dtype=None if args.autocast == "none"
                          else getattr(torch, args.autocast))
    save_dtype = getattr(torch, args.save_dtype)
    round_weights(heads, save_dtype)  # evaluate what the checkpoint will hold
    sets = {label: head_rows(ss, to_draft, cfg.num_heads)
            for label, ss in samples.items() if label != "train" and ss}
    # the tree: from the held-out split's accuracy by rank (else the first held-out set; with
    # none, the training rows': an optimistic tree, said so in the record)
    choose_from = "heldout" if "heldout" in sets else next(iter(sets), "train")
    rows = sets[choose_from] if choose_from in sets else (x, y)
    acc = rank_accuracy(label_ranks(heads, *rows, TREE_TOPK), TREE_TOPK)
    tree = choose_tree(acc, args.tree_nodes)
    print(f"tree of {len(tree)} nodes chosen on {choose_from}: {[list(p) for p in tree]}",
          flush=True)
    heads.config = cfg = MedusaConfig(**{**cfg.to_dict(), "tree": tree})
    evaluation = {}
    for label, (xs, ys) in sets.items():
        evaluation[label] = {"prompts": len(samples[label]),
                             **evaluate(heads, xs, ys, tree, TREE_TOPK)}
        print(report(label, evaluation[label]), flush=True)
    heads.config = MedusaConfig(**{**cfg.to_dict(), "heldout": {
        k: {m: v[m] for m in ("top1_per_head", "chain_acceptance_per_position",
                              "tree_acceptance_per_depth", "tree_mean_accepted")}
        for k, v in evaluation.items()}})
    training = training_record(prep, args, {**summary, "tree_chosen_on": choose_from},
                               evaluation)
    out = save_heads(heads, args.out, training, dtype=save_dtype)
    print(f"wrote {out} in {training['total_seconds'] / 60:.1f} min total "
          f"(--drafter medusa:{out})", flush=True)
    return evaluation
