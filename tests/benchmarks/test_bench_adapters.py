"""The bench's mixed-adapter load (``specmesh bench --lora-modules``, issue 37), pure: every
prompt goes out on the base model and on each adapter, each request naming its adapter in
``model``; the summary and the markdown split the served systems by adapter (requests,
tokens/s per client and its ratio to kappa = 0, acceptance and its ratio to the base's,
accepted drafts per verify step, identity to kappa = 0); only served systems run."""

from __future__ import annotations

import pytest

from specmesh.benchmarks.harness.bench import _schedule, adapter_notes
from specmesh.benchmarks.harness.render import adapter_markdown, markdown
from specmesh.benchmarks.harness.report import (
    BASE_MODEL_ROW,
    mixed_adapter_prompts,
    request_adapters,
    summarize,
    systems_for,
)
from specmesh.cluster.runs import RequestLatency, RunResult, run_openai_concurrent
from specmesh.protocol.spec_stats import SpecStats

PROMPTS = [{"name": "p0", "category": "chat", "messages": [{"role": "user", "content": "a"}]},
           {"name": "p1", "category": "chat", "messages": [{"role": "user", "content": "b"}]}]


def test_every_prompt_on_the_base_and_each_adapter():
    reqs = mixed_adapter_prompts(PROMPTS, ["caps", "json"])
    assert [(r["name"], r.get("model")) for r in reqs] == [
        ("p0", None), ("p0", "caps"), ("p0", "json"), ("p1", None), ("p1", "caps"),
        ("p1", "json")]
    assert request_adapters(reqs) == [BASE_MODEL_ROW, "caps", "json"] * 2
    assert "model" not in PROMPTS[0]  # copies
    assert mixed_adapter_prompts(PROMPTS, []) == PROMPTS


def _pass(name: str, ids, spec, seconds) -> RunResult:
    """A served pass of the 4 requests [p0 base, p0 caps, p1 base, p1 caps], 10 tokens each."""
    specs = [SpecStats(*x) for x in spec]
    run = RunResult(name, seconds=sum(seconds), num_tokens=40, texts=["t"] * 4, token_ids=ids,
                    latencies=[RequestLatency(0.1, s, 10) for s in seconds],
                    request_seconds=list(seconds), request_spec=specs,
                    request_prediction=[None] * 4)
    for s in specs:
        run.spec.add(s)
    return run


IDS = [[1], [2], [3], [4]]
# the base accepts 8 of 10 drafts per request, the adapter 2 of 10 (it changes the output)
SPEC = [(10, 8, 3), (10, 2, 5), (10, 8, 3), (10, 2, 5)]


def _summary(k4_ids=IDS) -> dict:
    runs = {"served k=4 ngram": [_pass("served k=4 ngram", k4_ids, SPEC, [0.5, 1.0, 0.5, 1.0])],
            "served k=0": [_pass("served k=0", IDS, [(0, 0, 0)] * 4, [1.0, 1.25, 1.0, 1.25])]}
    systems = [s for s in systems_for(4, 2) if s.name in runs]
    adapters = request_adapters(mixed_adapter_prompts(PROMPTS, ["caps"]))
    config = {"model": "tiny", "dtype": "float32", "kappa": 4, "max_tokens": 10,
              "num_prompts": 2, "repeats": 1, "threads": {"verifier": 2},
              "notes": adapter_notes(["caps"], 2)}
    return summarize(config, {2: runs}, {2: systems}, None, {2: ["chat"] * 4}, {2: adapters})


def test_served_systems_split_by_adapter():
    lv = _summary()["levels"]["2"]
    assert lv["adapters"] == [BASE_MODEL_ROW, "caps"]
    rows = lv["systems"]["served k=4 ngram"]["adapters"]
    base, caps = rows[BASE_MODEL_ROW], rows["caps"]
    assert base["num_requests"] == caps["num_requests"] == 2
    assert base["acceptance_rate"] == pytest.approx(0.8)
    assert caps["acceptance_rate"] == pytest.approx(0.2)
    assert caps["acceptance_vs_base"] == pytest.approx(0.25)
    assert base["acceptance_vs_base"] == pytest.approx(1.0)
    assert base["mean_accept_len"] == pytest.approx(16 / 6)
    assert caps["mean_accept_len"] == pytest.approx(4 / 10)
    assert base["median_tokens_per_s"] == pytest.approx(20.0)  # 20 tokens in 1 s
    assert caps["median_tokens_per_s"] == pytest.approx(10.0)
    assert base["ratio_to_k0"] == pytest.approx(2.0) and caps["ratio_to_k0"] == pytest.approx(1.25)
    assert base["exact"] is True and caps["exact"] is True


def test_a_mismatch_shows_on_its_adapter():
    lv = _summary(k4_ids=[[1], [9], [3], [4]])["levels"]["2"]
    rows = lv["systems"]["served k=4 ngram"]["adapters"]
    assert rows["caps"]["exact"] is False and rows[BASE_MODEL_ROW]["exact"] is True
    assert lv["mismatches"][0]["requests"] == [1]
    assert "**1/2 MISMATCH**" in "\n".join(adapter_markdown(lv))


def test_markdown_table_by_adapter_and_json_ready():
    import json

    summary = _summary()
    text = markdown(summary)
    assert "### by LoRA adapter, concurrency 2" in text
    assert "| caps | served k=4 ngram | 2 | 10.00 | 1.25 | 0.20 | 0.25 | 0.40 | 2/2 |" in text
    assert "| base | served k=4 ngram | 2 | 20.00 | 2.00 | 0.80 | 1.00 | 2.67 | 2/2 |" in text
    assert "mixed-adapter load (--lora-modules caps)" in text
    json.dumps(summary)  # the --json file
    # no adapters: no table
    lv = dict(summary["levels"]["2"], adapters=None)
    assert adapter_markdown(lv) == []


def test_mixed_load_schedules_served_systems_only():
    sched = _schedule([1, 2], 4, 2, ["ngram"], baselines=("hf",), only_served=True)
    assert {s.kind for _, _, s in sched} == {"served"}
    assert {s.name for _, _, s in sched} == {"served k=4 ngram", "served k=0"}
    assert any(s.kind == "hf" for _, _, s in _schedule([1], 4, 1, ["ngram"], baselines=("hf",)))


class _Client:
    """An OpenAI client that records the model each request names."""

    def __init__(self) -> None:
        self.models: list[str] = []
        self.chat = self
        self.completions = self

    def create(self, model, messages, max_tokens, temperature, extra_body=None):  # noqa: ANN001
        import types

        self.models.append(model)
        usage = types.SimpleNamespace(completion_tokens=1, model_extra={})
        msg = types.SimpleNamespace(content="x")
        choice = types.SimpleNamespace(message=msg, model_extra={"token_ids": [7]})
        return types.SimpleNamespace(usage=usage, choices=[choice], model_extra={})


def test_each_request_names_its_adapter():
    client = _Client()
    run_openai_concurrent(client, "base-model", mixed_adapter_prompts(PROMPTS, ["caps"]), 4,
                          "served k=0", 1)
    assert client.models == ["base-model", "caps"] * 2
