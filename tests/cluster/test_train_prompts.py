"""The bundled drafter-training prompts never show a held-out prompt to the head."""

import re

from specmesh.data.prompts import load_prompts_file
from specmesh.drafter.training.eagle import DEFAULT_TRAIN_PROMPTS, PROMPTS_DIR

HELDOUT = [PROMPTS_DIR / "drafter_heldout_chat.jsonl", PROMPTS_DIR / "drafter_heldout_code.jsonl"]


def _text(p: dict) -> str:
    return " ".join(m["content"] for m in p["messages"]).lower()


def _trigrams(text: str) -> set:
    w = re.findall(r"[a-z0-9']+", text)
    return set(zip(w, w[1:], w[2:]))


def test_names_unique_and_no_heldout_prompt_or_near_copy_in_training():
    train = [p for f in DEFAULT_TRAIN_PROMPTS for p in load_prompts_file(str(f))]
    held = [p for f in HELDOUT for p in load_prompts_file(str(f))]
    names = [p["name"] for p in train + held]
    assert len(names) == len(set(names))
    assert all(p["messages"][-1]["role"] == "user" for p in train)
    held_grams = [(p["name"], _trigrams(_text(p))) for p in held]
    close = []
    for p in train:
        g = _trigrams(_text(p))
        for name, h in held_grams:
            if g and h and len(g & h) / min(len(g), len(h)) >= 0.5:
                close.append((p["name"], name))
    assert not close, close
