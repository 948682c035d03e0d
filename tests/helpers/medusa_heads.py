"""Medusa heads for the tiny test target, trained by ``specmesh train-drafter --method
medusa`` in a few seconds on the prompts "Tell me about <topic>." (the tiny model's greedy
answers memorised well enough that drafts are accepted on those prompts; no held-out split, so
the tree is chosen on the training rows)."""

from __future__ import annotations

import json
from pathlib import Path

#: the prompts the heads are trained on (and the tests then send)
TOPICS = ["rivers", "python", "the moon", "tea", "primes", "bikes", "sorting", "volcanoes",
          "poetry", "search", "clouds", "chess"]


def train_tiny_medusa(model_dir: str, tmp: Path, num_heads: int = 3) -> tuple[str, list]:
    """Train heads for ``model_dir`` under ``tmp``; returns (checkpoint dir, the prompts' chat
    messages)."""
    from specmesh.cluster.cli import build_parser
    from specmesh.drafter.training.eagle import train_drafter

    prompts = [{"name": f"m{i}", "messages": [{"role": "user", "content": f"Tell me about {t}."}]}
               for i, t in enumerate(TOPICS)]
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = build_parser().parse_args([
        "train-drafter", "--method", "medusa", "--model", model_dir, "--prompts", str(path),
        "--heldout-fraction", "0", "--max-new-tokens", "32",
        "--gen-batch-size", "16", "--draft-vocab-size", "512", "--epochs", "60",
        "--batch-rows", "64", "--lr", "1e-2", "--num-heads", str(num_heads),
        "--tree-nodes", "6", "--out", str(tmp / "medusa")])
    train_drafter(args)
    return str(tmp / "medusa"), [p["messages"] for p in prompts]
