"""The soak's pieces without Ray (benchmarks/soak.py, issue 38): the load generator against an
in-process ASGI app that answers like the gateway (ok, refusals, a mid-stream error, a hang),
the role killer's schedule, and the report's checks and bounds (wrong outputs, failures
without a cause or too slow, leftovers, RSS growth)."""

from __future__ import annotations

import json
import random
import threading

import httpx
import pytest

from specmesh.cluster.soak_faults import RoleKiller
from specmesh.cluster.soak_load import KINDS, LoadGenerator, Outcome
from specmesh.cluster.soak_report import (RssTracker, build_report, failure_delay, failures,
                                          greedy_mismatches, leftovers, render,
                                          seeded_mismatches)

IDS = {"p1": [5, 6, 7], "p2": [8, 9]}


def _fake_gateway(request: httpx.Request) -> httpx.Response:
    """Answers /v1/completions as the gateway does: 400 on bad JSON or a wrong type, 413 on a
    large body, the prompt's fixed ids (streamed or not), and an error event for prompt p2 when
    streamed with seed 12."""
    try:
        body = json.loads(request.content)
    except ValueError:
        return httpx.Response(400, json={"error": {"message": "body is not valid JSON"}})
    if len(request.content) > 1 << 20:
        return httpx.Response(413, json={"error": {"message": "body over 1 MiB"}})
    if not isinstance(body.get("max_tokens"), int):
        return httpx.Response(400, json={"error": {"message": "max_tokens: not an int"}})
    prompt = body.get("prompt") or body["messages"][0]["content"]
    ids = IDS[prompt]
    if not body.get("stream"):
        return httpx.Response(200, json={"choices": [{"token_ids": ids, "finish_reason": "length"}],
                                         "spec_stats": {"num_accepted_tokens": 1}})
    events = [{"choices": [{"token_ids": [i], "finish_reason": None}]} for i in ids]
    if prompt == "p2" and body.get("seed") == 12:
        events.append({"error": {"message": "verifier verifier-0 restarted"}})
    else:
        events.append({"choices": [{"token_ids": [], "finish_reason": "length"}]})
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def _client() -> httpx.Client:
    return httpx.Client(base_url="http://soak", transport=httpx.MockTransport(_fake_gateway))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_is_recorded_as_the_server_answered(kind):
    load = LoadGenerator("http://soak", ["p1"])
    out = load.one(_client(), kind, random.Random(0))
    assert out.kind == kind and out.ok, out
    if kind in ("greedy", "greedy_stream", "chat", "sampled", "seeded"):
        assert out.token_ids == IDS["p1"]
    if kind in ("bad_json", "wrong_type", "oversized"):
        assert 400 <= out.status < 500 and out.cause


def test_a_mid_stream_error_is_a_failure_with_its_cause():
    load = LoadGenerator("http://soak", ["p2"], seeds=(12,))
    rng = random.Random(1)
    outs = [load.one(_client(), "seeded", rng) for _ in range(8)]
    streamed = [o for o in outs if not o.ok]
    assert streamed, "no seeded request was streamed"
    assert all(o.cause == "verifier verifier-0 restarted" for o in streamed)
    assert all(o.ok and o.token_ids == IDS["p2"] for o in outs if o not in streamed)


def test_a_request_that_hears_nothing_fails_without_a_cause():
    def hang(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    load = LoadGenerator("http://soak", ["p1"])
    client = httpx.Client(base_url="http://soak", transport=httpx.MockTransport(hang))
    out = load.one(client, "greedy", random.Random(0))
    assert not out.ok and out.cause == "" and "heard nothing" in out.note


def test_clients_run_until_stopped():
    load = LoadGenerator("http://soak", ["p1"], kinds={"greedy": 1, "bad_json": 1},
                         transport=httpx.MockTransport(_fake_gateway))
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    outs = load.run(3, stop)
    assert outs and all(o.ok for o in outs)
    assert {o.kind for o in outs} == {"greedy", "bad_json"}


def test_killer_kills_random_targets_and_records_errors():
    killed = []

    def kill(iid: str) -> None:
        killed.append(iid)
        if iid == "prefill-0":
            raise RuntimeError("actor gone")

    k = RoleKiller(["drafter-0", "prefill-0", "verifier-0"], kill, every_s=0.01,
                   rng=random.Random(4))
    for _ in range(30):
        k.kill_one()
    assert set(killed) == {"drafter-0", "prefill-0", "verifier-0"}
    assert [x.instance_id for x in k.kills] == killed
    assert all(bool(x.error) == (x.instance_id == "prefill-0") for x in k.kills)
    with pytest.raises(ValueError):
        RoleKiller(["gateway-0"], kill, every_s=1)


def test_killer_schedule_stops():
    stop = threading.Event()
    k = RoleKiller(["drafter-0"], lambda iid: stop.set() if len(k.kills) >= 2 else None,
                   every_s=0.01)
    t = k.start(stop)
    t.join(timeout=10)
    assert not t.is_alive() and len(k.kills) == 3


def _o(kind, prompt, ok=True, ids=None, cause="", stall=0.1, seed=None) -> Outcome:
    return Outcome(kind, prompt, ok, token_ids=ids, cause=cause, stall_s=stall, seed=seed)


def test_checks_count_wrong_outputs_and_bad_failures():
    ref = {("completion", "p1"): [1, 2], ("chat", "p1"): [3]}
    outs = [_o("greedy", "p1", ids=[1, 2]), _o("greedy_stream", "p1", ids=[1, 3]),
            _o("chat", "p1", ids=[3]), _o("greedy", "p1", ok=False, cause="lost"),
            _o("seeded", "p1", ids=[4], seed=1), _o("seeded", "p1", ids=[4], seed=1),
            _o("seeded", "p1", ids=[5], seed=1), _o("seeded", "p1", ids=[6], seed=2),
            _o("sampled", "p1", ok=False, stall=12.0, cause="slow"),
            _o("abort", "p1", ok=False)]
    assert greedy_mismatches(outs, ref) == (3, 1)
    assert seeded_mismatches(outs) == (2, 1)
    f = failures(outs)
    assert (f.count, f.without_cause, f.slow) == (3, 1, 1)

    stats = {"verifier-0": {"kv_cache_usage": 0.25, "num_kv_blocks": 8, "requests": [],
                            "num_waiting": 0},
             "prefill-0": {"num_used_kv_blocks": 5, "num_evictable_kv_blocks": 4},
             "drafter-0": {"num_requests": 0}, "gateway-0": {"num_in_flight": 1}}
    left = leftovers(stats)
    assert left == {"verifier_kv_blocks": 2, "verifier_requests": 0, "prefill_kv_blocks": 1,
                    "drafter_requests": 0, "gateway_in_flight": 1}
    rep = build_report(outs, ref, left, {}, {"minutes": 1})
    assert not rep["passed"]
    assert [b for b, ok in rep["verdict"].items() if not ok] == [
        "0 wrong greedy outputs", "0 wrong seeded outputs",
        "0 leaked KV blocks or request states", "every failure names its cause",
        "every failure within 10 s"]
    assert "FAIL  0 wrong greedy outputs" in render(rep)


def test_a_failure_is_timed_from_the_latest_kill_before_it():
    o = Outcome("greedy", "p1", ok=False, cause="verifier lost", ended=100.0, stall_s=30.0)
    assert failure_delay(o, []) == 30.0  # silent since its start at 70
    assert failure_delay(o, [60.0, 95.0, 101.0]) == 5.0  # killed at 95, failed at 100
    assert failures([o], [95.0]).slow == 0 and failures([o], [80.0]).slow == 1


def test_clean_report_passes():
    ref = {("completion", "p1"): [1, 2]}
    left = dict.fromkeys(("verifier_kv_blocks", "gateway_in_flight"), 0)
    rep = build_report([_o("greedy", "p1", ids=[1, 2]), _o("bad_json", "p1", cause="bad")],
                       ref, left, {}, {})
    assert rep["passed"] and rep["served"] == 1, rep["verdict"]


def test_rss_growth_after_each_processs_warm_up():
    mem = {10: 100, 11: 200}
    r = RssTracker(lambda pid: mem[pid], warmup_s=5)
    r.sample({"verifier-0": 10}, now=0)
    r.sample({"verifier-0": 10}, now=5)  # baseline 100
    mem[10] = 104
    r.sample({"verifier-0": 10, "drafter-0": 11}, now=6)
    assert r.growth()["verifier-0"]["growth"] == pytest.approx(0.04)
    assert r.growth()["drafter-0"]["growth"] is None  # not past its warm-up yet
    mem[10] = 110
    r.sample({"verifier-0": 10, "drafter-0": 99}, now=20)  # pid 99 gone: skipped
    g = r.growth()
    assert g["verifier-0"]["growth"] == pytest.approx(0.10) and g["verifier-0"]["window_s"] == 15
    left = {"verifier_kv_blocks": 0}
    rep = build_report([_o("greedy", "p1", ids=[1])], {("completion", "p1"): [1]}, left, g, {})
    assert not rep["verdict"]["RSS growth < 5% after warm-up"]
