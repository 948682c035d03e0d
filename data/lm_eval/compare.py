"""Compare lm-evaluation-harness runs sample by sample (docs/benchmarks.md,
"lm-evaluation-harness"): loglikelihood tasks by each choice's loglikelihood (largest absolute
difference, and whether the argmax answer differs), generate_until tasks by the generated text
(identical or not).

Usage: ``python data/lm_eval/compare.py DIR_A DIR_B [TASK ...]`` where each DIR is an
``--output_path`` of ``lm_eval ... --log_samples`` (the newest ``samples_<task>_*.jsonl`` under
it is read). Prints one line per task; exits 1 when a loglikelihood differs by more than
``--atol`` (default 1e-4), an answer differs, or a generation differs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def _samples(root: str, task: str) -> dict[int, dict]:
    """doc_id -> sample of the newest samples file of ``task`` under ``root``."""
    files = sorted(glob.glob(os.path.join(root, "**", f"samples_{task}_*.jsonl"),
                             recursive=True))
    if not files:
        raise SystemExit(f"no samples_{task}_*.jsonl under {root}")
    with open(files[-1]) as f:
        return {s["doc_id"]: s for s in map(json.loads, f)}


def _tasks(root: str) -> list[str]:
    names = set()
    for path in glob.glob(os.path.join(root, "**", "samples_*.jsonl"), recursive=True):
        base = os.path.basename(path)[len("samples_"):]
        names.add(base.rsplit("_", 1)[0])
    return sorted(names)


def compare(a: dict[int, dict], b: dict[int, dict], atol: float) -> tuple[str, bool]:
    """A one-line summary of the two runs of one task and whether they agree."""
    if a.keys() != b.keys():
        return f"different documents ({len(a)} vs {len(b)})", False
    first = next(iter(a.values()))
    resp = first["resps"][0][0]
    if isinstance(resp, list):  # loglikelihood: [[logprob, is_greedy]] per choice
        worst, answers = 0.0, 0
        for doc, s in a.items():
            la = [r[0][0] for r in s["resps"]]
            lb = [r[0][0] for r in b[doc]["resps"]]
            worst = max([worst] + [abs(float(x) - float(y)) for x, y in zip(la, lb)])
            answers += la.index(max(la)) != lb.index(max(lb))
        ok = worst <= atol and answers == 0
        return (f"{len(a)} docs, max |loglikelihood difference| {worst:.2e}, "
                f"{answers} answers differ"), ok
    same = sum(s["resps"][0][0] == b[doc]["resps"][0][0] for doc, s in a.items())
    return f"{len(a)} docs, {same}/{len(a)} generations identical", same == len(a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("tasks", nargs="*", help="default: every task of run_a")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    ok = True
    for task in args.tasks or _tasks(args.run_a):
        line, agree = compare(_samples(args.run_a, task), _samples(args.run_b, task), args.atol)
        print(f"{task}: {line}")
        ok &= agree
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
