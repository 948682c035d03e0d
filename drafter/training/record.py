"""What a trained drafter's checkpoint records of how it was made (both methods of
``specmesh train-drafter``: the EAGLE head's config.json, the draft model's
specmesh_draft.json): the command, the prompt split, the data, the timings and the numbers."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch


def training_record(prep: dict, args: argparse.Namespace, summary: dict,
                    evaluation: dict) -> dict:
    """What a checkpoint records of how it was made: command, split, data, timings, numbers."""
    return {"command": "specmesh train-drafter " + " ".join(shlex.quote(a) for a in
                                                            sys.argv[2:]),
            "train_prompts": len(prep["train_p"]), "heldout_prompts": len(prep["held_p"]),
            "heldout_names": [p["name"] for p in prep["held_p"]],
            "train_output_tokens": sum(s.num_output_tokens for s in prep["samples"]["train"]),
            "generate_seconds": round(prep["generate_seconds"], 1),
            "total_seconds": round(time.perf_counter() - prep["t_start"], 1),
            "threads": torch.get_num_threads(), **summary, "evaluation": evaluation,
            "args": {k: v for k, v in vars(args).items() if k != "func"}}
