"""A frozen-KV MTP assistant for the tiny test target, trained by ``specmesh train-drafter
--method frozen-kv-mtp`` in seconds on the prompts "Tell me about <topic>." (the tiny model's
greedy answers memorised well enough that drafts are accepted on those prompts; no held-out
split; one thread: the tiny products lose more to a thread team's waits than they gain)."""

from __future__ import annotations

import json
from pathlib import Path

#: the prompts the assistant is trained on (and the served tests then send)
TOPICS = ["rivers", "python", "the moon", "tea", "primes", "bikes", "sorting", "volcanoes",
          "poetry", "search", "clouds", "chess"]


def train_tiny_frozen_kv(model_dir: str, tmp: Path) -> tuple[str, list]:
    """Train an assistant for ``model_dir`` under ``tmp``; returns (checkpoint dir, the
    prompts' chat messages)."""
    from specmesh.cluster.cli import build_parser
    from specmesh.drafter.training.eagle import train_drafter

    prompts = [{"name": f"f{i}", "messages": [{"role": "user", "content": f"Tell me about {t}."}]}
               for i, t in enumerate(TOPICS)]
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = build_parser().parse_args([
        "train-drafter", "--method", "frozen-kv-mtp", "--model", model_dir, "--prompts",
        str(path), "--heldout-fraction", "0", "--max-new-tokens", "32", "--gen-batch-size", "16",
        "--draft-vocab-size", "512", "--epochs", "30", "--batch-size", "4", "--depth", "3",
        "--lr", "1e-2", "--threads", "1", "--out", str(tmp / "frozen-kv")])
    train_drafter(args)
    return str(tmp / "frozen-kv"), [p["messages"] for p in prompts]
