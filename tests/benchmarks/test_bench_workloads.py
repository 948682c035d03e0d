"""The bundled workload set (data/workloads.jsonl, ``--prompts workloads``): its schema, its
categories, predictions on the code edits only, and every prompt within SmolLM2's budget under
its real chat template; and the ``prediction`` field of a prompts file."""

import json
import re

import pytest

from specmesh.data.prompts import (
    WORKLOAD_CATEGORIES,
    WORKLOADS,
    load_prompt_set,
    load_workloads,
    parse_prompts_jsonl,
)
from specmesh.gateway.tokens import chat_prompt_ids

#: prompt tokens (chat template included) every workload prompt stays under
MAX_PROMPT_TOKENS = 1500


@pytest.fixture(scope="module")
def workloads():
    return load_workloads()


def _by_category(prompts, category):
    return [p for p in prompts if p["category"] == category]


def test_every_line_parses_into_a_known_category(workloads):
    names = [p["name"] for p in workloads]
    assert len(names) == len(set(names))
    assert {p["category"] for p in workloads} == set(WORKLOAD_CATEGORIES)
    for c in WORKLOAD_CATEGORIES:
        assert 5 <= len(_by_category(workloads, c)) <= 8, c
    for p in workloads:
        assert p["messages"][-1]["role"] == "user", p["name"]
    assert load_prompt_set(WORKLOADS) == workloads


def test_predictions_only_on_code_edits_and_they_are_the_original_code(workloads):
    for p in workloads:
        if p["category"] != "code-edit":
            assert "prediction" not in p, p["name"]
            continue
        code = p["prediction"]
        assert 15 <= len(code.splitlines()) <= 40, p["name"]
        # the prediction is the snippet the instruction edits, as sent in the prompt
        assert code in p["messages"][-1]["content"], p["name"]


def test_extraction_passages_and_multi_turn_conversations(workloads):
    for p in _by_category(workloads, "extraction"):
        passage = p["messages"][-1]["content"].rsplit("\n\n", 1)[0]
        assert 150 <= len(re.findall(r"\S+", passage)) <= 400, p["name"]
    for p in _by_category(workloads, "multi-turn"):
        roles = [m["role"] for m in p["messages"]]
        assert "assistant" in roles[:-1] and roles[-1] == "user", p["name"]


def test_every_prompt_fits_the_token_budget(workloads, smollm2_tokenizer):
    for p in workloads:
        n = len(chat_prompt_ids(smollm2_tokenizer, p["messages"]))
        assert n < MAX_PROMPT_TOKENS, (p["name"], n)


def test_a_prompts_file_may_carry_a_prediction():
    line = {"name": "edit", "category": "code-edit", "prediction": "x = 1\n",
            "messages": [{"role": "user", "content": "Rename x to y:\nx = 1\n"}]}
    got = parse_prompts_jsonl(json.dumps(line) + "\n" + json.dumps({"prompt": "hi"}))
    assert got[0]["prediction"] == "x = 1\n"
    assert "prediction" not in got[1]
    for bad in ("", 3, ["x"]):
        with pytest.raises(SystemExit, match=r"line 1: \"prediction\" must be a non-empty"):
            parse_prompts_jsonl(json.dumps({**line, "prediction": bad}), "p.jsonl")


def test_a_file_named_like_the_set_is_read_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workloads").write_text(json.dumps({"prompt": "mine"}))
    assert [p["messages"][0]["content"] for p in load_prompt_set("./workloads")] == ["mine"]


def test_the_cli_takes_the_workload_set(monkeypatch):
    """``specmesh bench --prompts workloads`` passes the CLI's early prompts check (a name,
    not a file) and reaches the bench with it."""
    from specmesh.benchmarks.harness import bench as bench_module
    from specmesh.cluster.cli import main

    seen = {}

    def fake_bench(cfg, opts):
        seen["prompts"] = bench_module.bench_prompts(opts)
        return {"mismatches": []}

    monkeypatch.setattr(bench_module, "bench", fake_bench)
    assert main(["bench", "--prompts", WORKLOADS, "--num-prompts", "2"]) == 0
    assert seen["prompts"] == load_workloads()[:2]


def test_no_workload_prompt_is_a_near_copy_of_a_training_prompt(workloads):
    """The shipped EAGLE heads learned from the drafter-training files: a workload prompt that
    nearly repeats one of them (half its word trigrams or more, the held-out files' rule in
    tests/cluster/test_train_prompts.py) would flatter the heads."""
    from specmesh.data.prompts import load_prompts_file
    from specmesh.drafter.training.eagle import DEFAULT_TRAIN_PROMPTS

    def trigrams(p: dict) -> set:
        w = re.findall(r"[a-z0-9']+", " ".join(m["content"] for m in p["messages"]).lower())
        return set(zip(w, w[1:], w[2:]))

    train = [trigrams(p) for f in DEFAULT_TRAIN_PROMPTS for p in load_prompts_file(str(f))]
    close = [(p["name"], round(len(g & h) / min(len(g), len(h)), 2))
             for p in workloads if (g := trigrams(p))
             for h in train if h and len(g & h) / min(len(g), len(h)) >= 0.5]
    assert not close, close
