"""What rounding the EAGLE head to Q8_0 (drafter/eagle/quantize.py) costs and buys: the shipped
head for SmolLM2 loaded twice in one process, float32 (the CPU backend's ``eagle_q8_0`` off,
engine/backend.py) and on Q8_0 blocks, then

- the time of one draft's pieces on the drafter's one thread, interleaved, medians (ms): the
  LM head over the draft vocabulary, one head entry (fusion layer + decoder layer) at 40 entries
  of context, and the fusion of one true seed-state row;
- acceptance per draft position of both heads on SmolLM2's own greedy answers (float32,
  ``MAX_NEW`` tokens) to the held-out chat prompts, scored as ``specmesh train-drafter``
  scores a head (drafter/eagle/train.py ``acceptance``).

    python benchmarks/eagle_q8_ab.py [MAX_NEW]   # default 64
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specmesh.drafter.eagle.data import chat_token_ids, generate_samples
from specmesh.drafter.eagle.head_kv import HeadKV
from specmesh.drafter.eagle.train import acceptance, acceptance_report, windows
from specmesh.drafter.proposers.eagle import load_eagle_head
from specmesh.engine.backend import BackendOverrides, cpu_backend
from specmesh.engine.loader import load_model

PROMPTS = Path(__file__).resolve().parent.parent / "data/drafter_heldout_chat.jsonl"


def load(q8: bool):  # noqa: ANN201
    return load_eagle_head(None, None, backend=cpu_backend(BackendOverrides(eagle_q8_0=q8)))


def median_ms(fn, n: int = 100) -> float:  # noqa: ANN001
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    max_new = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    heads = {"float32": load(False), "q8_0": load(True)}
    torch.set_num_threads(1)
    d = heads["float32"].config.hidden_size
    g, feats = torch.randn(1, d), torch.randn(40, d)
    seed = torch.randn(1, heads["float32"].config.seed_width)
    times: dict[str, dict[str, list[float]]] = {k: {} for k in heads}
    with torch.inference_mode():
        for _ in range(3):
            for name, h in heads.items():
                kv = HeadKV()
                h.extend_many([(kv, feats, torch.randint(0, 1000, (40,)), 0)])

                def entry(h=h, kv=kv) -> None:  # noqa: ANN001 - bound per head
                    h.extend_many([(kv, g, torch.tensor([5]), kv.end)])
                    kv.truncate(kv.end - 1)

                for piece, fn in (("lm_head", lambda h=h: h.logits(g)), ("entry", entry),
                                  ("seed_fusion", lambda h=h: h.seed_features(seed))):
                    times[name].setdefault(piece, []).append(median_ms(fn))
    print("one draft's pieces, 1 thread, median of 3 interleaved rounds (ms):")
    for name, pieces in times.items():
        print(f"  {name}: " + ", ".join(f"{p} {statistics.median(v):.3f}"
                                        for p, v in pieces.items()))

    torch.set_num_threads(2)
    lm = load_model(None, "float32")
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    layers = tuple(heads["float32"].config.feature_layers) or None
    samples = generate_samples(lm.model, lm.config, chat_token_ids(lm.tokenizer, prompts),
                               [p["name"] for p in prompts], max_new_tokens=max_new,
                               batch_size=len(prompts), hidden_layers=layers)
    print(f"acceptance on {len(prompts)} held-out chat prompts, {max_new} output tokens:")
    for name, h in heads.items():
        to_draft = torch.full((h.config.vocab_size,), -1, dtype=torch.long)
        to_draft[h.draft_to_target] = torch.arange(h.draft_to_target.numel())
        print(f"  {name}: {acceptance_report(acceptance(h, windows(samples, to_draft), 5))}")


if __name__ == "__main__":
    main()
