"""The goodput policy on a profiled verify-cost table (decode/cost_table.py, decode/goodput.py,
cluster/verify_cost.py, engine/verify_cost_probe.py): the step function over buckets, the
kappa it picks per request for scripted costs and acceptance, the drafter's cost on shared
cores, the online refinement, the file form and the cache keyed by model, dtype, KV-cache
dtype and CPU. No timing assertions: every cost here is scripted, but the probe's."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from specmesh.cluster.auto import AutoCache
from specmesh.cluster.options import cost_table_settings
from specmesh.cluster.verify_cost import cached_or_measured, cost_key, verifier_cost_table
from specmesh.decode.config import VerifierConfig
from specmesh.decode.cost_table import (
    TABLE_EMA_WEIGHT,
    VerifyCostTable,
    load_cost_table,
    table_from_dict,
)
from specmesh.decode.goodput import DraftBudget

WIDTHS = (1, 2, 4, 8)


def table(costs: dict[int, float], batch_sizes=(1, 2, 4), per_batch: float = 0.0,
          drafter_s: float = 0.0) -> VerifyCostTable:
    """A scripted table: ``costs[width]`` at batch 1, plus ``per_batch`` per extra request."""
    return VerifyCostTable(batch_sizes, WIDTHS,
                           {(b, w): costs[w] + per_batch * (b - 1)
                            for b in batch_sizes for w in WIDTHS}, drafter_s)


# a CPU without cheap wide products: 2 tokens ~ 1 token, 4 tokens twice, 8 four times
STEPPED = {1: 1.0, 2: 1.05, 4: 2.0, 8: 4.0}


def test_lookup_is_a_step_function_over_padded_buckets():
    t = table({1: 1.0, 2: 1.5, 4: 2.0, 8: 3.0}, per_batch=1.0)
    assert t.bucket(3, 3) == (4, 1)  # batch 3 runs as 4
    assert t.bucket(1, 3) == (1, 4)  # 3 tokens per request run as 4
    assert t.predict(3, 3) == t.predict(4, 4) == 4.0  # no interpolation inside a bucket
    assert t.predict(1, 3) == t.predict(1, 4) == 2.0
    assert t.predict(1, 2) == 1.5 and t.predict(1, 1) == 1.0  # jumps at the edges
    # past the largest bucket: the largest one's cost, scaled by the tokens
    assert t.predict(8, 8) == pytest.approx(4.0 * 2)
    assert t.predict(1, 16) == pytest.approx(3.0 * 2)


def test_goodput_picks_the_kappa_that_maximises_tokens_per_second():
    # one request, 7 drafts ready: n drafts commit 1 + a + ... + a^n in T(width n + 1)
    budget = DraftBudget(table(STEPPED))
    # a = 0.9: n=1 -> 1.9/1.05 = 1.81; n=3 -> 3.44/2 = 1.72; n=7 -> 5.70/4 = 1.42
    assert budget.cap([7], [0.9]) == 1
    # a = 0.97: n=3 -> 3.83/2 = 1.91 beats n=1 -> 1.97/1.05 = 1.88
    assert budget.cap([7], [0.97]) == 3
    # a = 0.03: one draft 1.03/1.05 < 1: plain decode
    assert budget.cap([7], [0.03]) == 0
    # a flat table (a bf16 CPU, a GPU below its knee): every draft pays
    assert DraftBudget(table({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})).cap([7], [0.5]) == 7


def test_goodput_kappa_is_per_request():
    budget = DraftBudget(table(STEPPED, per_batch=0.5))
    caps = budget.decide([3, 3], [0.95, 0.05])
    # a ragged batch's width is its tokens per request: 2 requests + 2 drafts fill bucket
    # (2, 2) at 1.55 s, a third draft moves the step to (2, 4) at 2.5 s. The matching
    # request takes two drafts ((2 + .95 + .90) / 1.55 = 2.49 beats 2 / 1.5 and
    # 4.71 / 2.5), the failing one none (its first draft's .05 is worth less than the .90)
    assert caps.cap(0.95, 3) == 2
    assert caps.cap(0.05, 3) == 0


def test_drafter_cost_counts_when_it_shares_the_cores():
    shared = DraftBudget(table({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, drafter_s=0.5))
    assert shared.cap([4], [0.6]) == 4  # on its own cores the drafter's time is free
    shared.drafter_shared = True
    # each draft now costs 0.5 s: one draft 1.6 / 1.5 = 1.07 beats none, two 1.96 / 2 loses
    assert shared.cap([4], [0.6]) == 1


def test_online_ema_refines_the_bucket_it_falls_in():
    t = table(STEPPED)
    b = DraftBudget(t)
    b.observe_forward(3, 4.0, batch=1)  # width 3 -> bucket (1, 4)
    assert t.seconds[(1, 4)] == pytest.approx(2.0 + TABLE_EMA_WEIGHT * 2.0)
    assert t.seconds[(1, 8)] == 4.0 and t.num_observed == 1
    b.observe_forward(40, 9.0, batch=1)  # past the largest width: not a bucket's cost
    b.observe_forward(3, 9.0)  # batch not told: the table is left alone
    assert t.num_observed == 1


def test_table_file_round_trip_and_errors(tmp_path):
    t = table(STEPPED, drafter_s=0.01)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(t.as_dict()))
    back = load_cost_table(path)
    assert back.seconds == t.seconds and back.drafter_s_per_draft == 0.01
    assert back.source == str(path)
    bad = t.as_dict()
    bad["seconds"] = bad["seconds"][1:]  # (1, 1) missing
    with pytest.raises(ValueError, match="batch 1, width 1"):
        table_from_dict(bad)
    with pytest.raises(ValueError, match="starting at 1"):
        VerifyCostTable((2, 4), WIDTHS, {})
    with pytest.raises(ValueError, match="malformed"):
        table_from_dict({"batch_sizes": [1]})
    # the option: read where the command runs, a clear error for a bad file
    got = cost_table_settings(argparse.Namespace(verify_cost_table=str(path)))
    assert got["verify_cost_table_data"] == t.as_dict()
    assert cost_table_settings(argparse.Namespace(verify_cost_table="off")) == {}
    assert cost_table_settings(argparse.Namespace(verify_cost_table="auto")) == \
        {"verify_cost_table": "auto"}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match="--verify-cost-table"):
        cost_table_settings(argparse.Namespace(verify_cost_table=str(tmp_path / "bad.json")))


def _key(**change) -> dict:
    base = dict(model={"kind": "gguf", "path": "/m.gguf", "files": [["m.gguf", 1, 2]]},
                dtype="float32", kv_cache_dtype="auto",
                cpu={"machine": "x86_64", "model_name": "A", "flags": "f1"},
                torch_version="2.5", threads=2)
    base.update(change)
    return cost_key(**base)


def test_cache_is_invalidated_by_model_dtype_or_cpu(tmp_path):
    cache = AutoCache(tmp_path)
    calls = []

    def measure():
        calls.append(1)
        return {(b, w): 0.01 * b * w for b in (1, 2, 4, 8, 16) for w in WIDTHS}

    first = cached_or_measured(_key(), measure, cache)
    assert first.source == "measured" and len(calls) == 1
    again = cached_or_measured(_key(), measure, cache)
    assert again.source == "cached" and again.seconds == first.seconds and len(calls) == 1
    for change in (dict(model={"kind": "gguf", "path": "/m.gguf", "files": [["m.gguf", 1, 3]]}),
                   dict(dtype="bfloat16"), dict(kv_cache_dtype="bfloat16"),
                   dict(cpu={"machine": "x86_64", "model_name": "B", "flags": "f1"}),
                   dict(threads=4)):
        n = len(calls)
        assert cached_or_measured(_key(**change), measure, cache).source == "measured"
        assert len(calls) == n + 1, change
    # a corrupt entry is measured again
    cache.path(_key()).write_text("{\"key\": 1}")
    assert cached_or_measured(_key(), measure, cache).source == "measured"


def test_verifier_table_only_under_the_goodput_policy():
    data = table(STEPPED).as_dict()
    cfg = VerifierConfig(goodput_drafts=True, verify_cost_table="costs.json",
                         verify_cost_table_data=data)
    got = verifier_cost_table(cfg, None, None, "float32", "auto", 1)
    assert got is not None and got.source == "costs.json"
    for off in (VerifierConfig(goodput_drafts=True),  # none asked for
                VerifierConfig(goodput_drafts=True, speculative_policy="fixed",
                               verify_cost_table="auto")):
        assert verifier_cost_table(off, None, None, "float32", "auto", 1) is None
    with pytest.raises(ValueError, match="verify_cost_table_data"):
        VerifierConfig(verify_cost_table="costs.json")


def test_probe_times_real_forwards_of_every_bucket():
    from helpers.models import tiny_llama
    from specmesh.engine.kv_cache import KVCache
    from specmesh.engine.runner import ModelRunner
    from specmesh.engine.verify_cost_probe import measure_verify_costs

    _, model, cfg = tiny_llama(dtype=torch.float32)
    runner = ModelRunner(model, cfg, KVCache(cfg, 64, 16, torch.float32))
    got = measure_verify_costs(runner, (1, 2, 4), (1, 2, 4), rounds=1, context_len=16)
    assert set(got) == {(b, w) for b in (1, 2, 4) for w in (1, 2, 4)}
    assert all(t > 0 for t in got.values())
    VerifyCostTable((1, 2, 4), (1, 2, 4), got)  # a valid table
    with pytest.raises(ValueError, match="KV blocks"):
        measure_verify_costs(runner, (1, 128), (1, 2), rounds=1)
