"""SGLang's adaptive kappa schedule (decode/kappa_schedule.py) with scripted acceptance:
warm-up, cadence, down before up, the asymmetric hysteresis at batch 1, slot rounding, the
probe up from 0, schedule files; the scheduler's step kappa and policies; and, end to end in
the in-process cluster, a change that reaches a running request at its next step with the
output unchanged."""

from __future__ import annotations

import json
import logging

import pytest

from specmesh.decode.config import VerifierConfig
from specmesh.decode.kappa_schedule import (
    DEFAULT_SCHEDULE,
    KappaSchedule,
    ScheduleConfig,
    ScheduleSlot,
    load_schedule,
    parse_schedule,
)


def run(schedule: KappaSchedule, batch: int, accepted: float, steps: int) -> list[tuple]:
    """``steps`` steps of ``batch`` requests each accepting ``accepted`` drafts (capped at the
    step's kappa); returns (step number in its slot, old, new) of every change."""
    moves = []
    for _ in range(steps):
        k = schedule.kappa_for(batch)
        ch = schedule.observe(batch, [min(accepted, k)] * batch if k else [])
        if ch is not None:
            moves.append((schedule.slot_for(batch).num_steps, ch.old, ch.new))
    return moves


def test_default_slots_and_initial_kappa():
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=4)
    # 4 is no candidate anywhere: every slot starts at its middle candidate (SGLang's rule)
    assert [s.states[b].kappa for b in (1, 8, 32, 64)] == [3, 1, 1, 0]
    assert s.states[1].ema_accept_len == 2.0  # kappa - 1: neutral
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=3)
    assert [s.states[b].kappa for b in (1, 8, 32, 64)] == [3, 3, 1, 0]


def test_slot_rounding():
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=3)
    assert [s.slot_for(b).slot.batch_size for b in (1, 2, 8, 9, 32, 33, 40, 64, 65, 500)] == \
        [1, 8, 8, 32, 32, 64, 64, 64, 64, 64]
    assert s.kappa_for(40) == 0  # batch 40 -> slot 64 -> kappa 0: speculation off
    assert s.current_kappa == 0
    assert s.kappa_for(1) == 3 and s.current_kappa == 3


def test_warmup_then_a_decision_every_five_steps():
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=3)
    # every draft accepted at batch 1: the EMA passes 2.5 on the third step, but nothing moves
    # during the 10 warm-up steps nor before the 5th step after them
    assert run(s, 1, 7, 14) == []
    assert s.states[1].ema_accept_len > 2.5
    assert run(s, 1, 7, 1) == [(15, 3, 7)]
    # then all rejected: the EMA falls from ~3.4 (0.8^n), decisions only at 20, 25, 30...
    moves = run(s, 1, 0, 40)
    assert moves and all((n - 10) % 5 == 0 for n, _, _ in moves)
    # down as far as the EMA says in each decision: ~1.1 after 5 steps (3 needs <= 2.25, 1
    # needs <= 0.25), ~0.36 at step 25 (kept), ~0.12 at step 30
    assert moves[:2] == [(20, 7, 3), (30, 3, 1)]
    # slots count their own steps: the batch-8 slot has not left its warm-up
    assert s.states[8].num_steps == 0 and run(s, 8, 0, 14) == []


def test_down_is_decided_before_up():
    """A slot whose thresholds let both moves fire goes down and does not come back up in
    the same decision."""
    cfg = ScheduleConfig((ScheduleSlot(1, (1, 3, 7), up_hysteresis=-3.0,
                                       down_hysteresis=0.0),))
    s = KappaSchedule(cfg, initial_kappa=3)
    moves = run(s, 1, 0, 15)
    st = s.states[1]
    # the EMA (2 * 0.8^15 ~ 0.07) is below the drop threshold 0.5 and above the rise one -0.5
    assert st.ema_accept_len <= 0.5 and st.ema_accept_len > 3 - 0.5 - 3.0
    assert moves == [(15, 3, 1)]


def test_hysteresis_is_asymmetric_at_batch_1():
    """At batch 1 the default slot drops only a quarter token lower than a slot without
    hysteresis would: an EMA of 0.4 at kappa 3 keeps 3 (drop needs <= 0.25), while rising
    needs only > 2.5."""
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=3)
    assert run(s, 1, 0.4, 60) == []
    assert s.states[1].ema_accept_len == pytest.approx(0.4, abs=0.01) and s.kappa_for(1) == 3
    plain = KappaSchedule(ScheduleConfig((ScheduleSlot(1, (1, 3, 7)),)), initial_kappa=3)
    assert run(plain, 1, 0.4, 15) == [(15, 3, 1)]  # same EMA without hysteresis: drops
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=3)
    assert run(s, 1, 2.6, 40)[0] == (15, 3, 7)  # 2.6 > 3 - 0.5: up, no hysteresis that way
    low = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=3)
    # EMA 0.1 + 1.9 * 0.8^15 = 0.17 <= 1 - 0.5 - 0.25: down
    assert run(low, 1, 0.1, 15) == [(15, 3, 1)]


def test_zero_kappa_probes_up_and_falls_back():
    """At batch 8 drafts that keep failing take kappa to 0; with nothing verified the EMA
    stands still and each decision probes kappa 1 again (SGLang's), which the next one drops
    while they still fail."""
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=1)
    moves = run(s, 8, 0, 40)
    assert moves[0] == (15, 1, 0)
    assert [m[1:] for m in moves[1:4]] == [(0, 1), (1, 0), (0, 1)]
    # drafts that match again keep it up and rise to 3
    assert (1, 3) in [m[1:] for m in run(s, 8, 3, 30)]


def test_change_is_logged_as_sglang_does(caplog):
    s = KappaSchedule(DEFAULT_SCHEDULE, initial_kappa=3)
    with caplog.at_level(logging.INFO, logger="specmesh.decode.kappa_schedule"):
        run(s, 1, 0, 15)
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith("adaptive: kappa 3 -> 1 (ema_accept_len=0.07, batch=1)")
    assert s.changes[0].old == 3 and s.changes[0].new == 1


def test_schedule_file_overrides_the_default(tmp_path):
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps({"1": {"candidate_steps": [2, 5]}, "16": [0, 2],
                                "ema_alpha": 0.5, "update_interval": 2,
                                "warmup_batches": 1}))
    cfg = load_schedule(str(path))
    assert [s.batch_size for s in cfg.slots] == [1, 16]
    assert cfg.slots[0].down_hysteresis == -0.25 and cfg.slots[1].candidates == (0, 2)
    assert (cfg.ema_weight, cfg.decision_every, cfg.warmup_steps) == (0.5, 2, 1)
    assert cfg.max_kappa == 5
    s = KappaSchedule(cfg, initial_kappa=4)
    assert s.kappa_for(40) == 2  # past the largest slot: the largest
    # slot 1 starts at 5 (its middle), EMA 4; weight 0.5, 1 warm-up step, a decision every 2:
    # at step 3 the EMA is 0.5 <= 2 - 0.5 - 0.25
    assert run(s, 1, 0, 3) == [(3, 5, 2)]


def test_policy_options(tmp_path):
    import argparse

    from specmesh.cluster.cli import build_parser
    from specmesh.cluster.options import policy_settings

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"1": [1, 2], "4": [0, 1]}))
    args = build_parser().parse_args(["serve", "--speculative-schedule", str(path)])
    got = policy_settings(args)
    assert got["speculative_policy"] == "schedule"
    assert [sl.candidates for sl in got["speculative_schedule"].slots] == [(1, 2), (0, 1)]
    args = build_parser().parse_args(["serve", "--speculative-policy", "fixed"])
    assert policy_settings(args) == {"speculative_policy": "fixed"}
    assert policy_settings(argparse.Namespace()) == {"speculative_policy": "goodput"}
    with pytest.raises(SystemExit, match="goes with --speculative-policy schedule"):
        policy_settings(argparse.Namespace(speculative_policy="goodput",
                                           speculative_schedule=str(path)))
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="--speculative-schedule: speculative schedule"):
        policy_settings(argparse.Namespace(speculative_policy=None,
                                           speculative_schedule=str(path)))


@pytest.mark.parametrize("obj, match", [
    ([1, 3], "JSON object"),
    ({}, "at least one"),
    ({"big": [1]}, "unknown schedule key"),
    ({"1": {"candidate_steps": []}}, "non-empty list"),
    ({"1": {"candidate_steps": [1, -1]}}, "integers >= 0"),
    ({"1": {"candidate_steps": [1], "ceiling_coeff": 2}}, "ceiling_coeff"),
    ({"1": {"candidate_steps": [1], "speed": 2}}, "unknown keys"),
    ({"0": [1]}, "batch sizes >= 1"),
    ({"1": [1], "ema_alpha": 0}, "ema_alpha"),
    ({"1": [1], "update_interval": 0.5}, "integer"),
])
def test_bad_schedules_are_refused(obj, match):
    with pytest.raises(ValueError, match=match):
        parse_schedule(obj)


def test_verifier_config_checks_the_policy():
    with pytest.raises(ValueError, match="speculative_policy"):
        VerifierConfig(speculative_policy="greedy")
    with pytest.raises(ValueError, match="'schedule' only"):
        VerifierConfig(speculative_schedule=DEFAULT_SCHEDULE)
    with pytest.raises(ValueError, match="exceeds max_num_speculative_tokens"):
        VerifierConfig(speculative_policy="schedule", num_speculative_tokens=4,
                       max_num_speculative_tokens=5)  # the default's 7
    cfg = VerifierConfig(speculative_policy="schedule", goodput_drafts=True)
    assert not cfg.accept_len_caps and not cfg.goodput_caps and cfg.widest_kappa == 7
    fixed = VerifierConfig(speculative_policy="fixed", goodput_drafts=True)
    assert not fixed.accept_len_caps and not fixed.goodput_caps and fixed.widest_kappa == 4
    assert VerifierConfig(goodput_drafts=True).goodput_caps  # goodput: today's caps


def _scheduler(policy: str):
    from specmesh.decode.request import Request, RequestStatus
    from specmesh.decode.scheduler import Scheduler
    from specmesh.engine.block_manager import BlockManager
    from specmesh.protocol.messages import SamplingParams

    sched = Scheduler(VerifierConfig(speculative_policy=policy, num_speculative_tokens=4),
                      BlockManager(64, 4))
    reqs = []
    for i in range(2):
        r = Request(f"r{i}", "gw", [1, 2, 3], SamplingParams(max_tokens=50),
                    sched.speculative_tokens_for(None))
        r.status, r.drafter = RequestStatus.RUNNING, "drafter-0"
        reqs.append(r)
    return sched, reqs


def test_scheduler_step_kappa_caps_every_request():
    sched, reqs = _scheduler("schedule")
    assert [r.num_speculative_tokens for r in reqs] == [7, 7]  # the schedule's widest
    sched.begin_step(reqs[:1])
    assert sched.step_kappa == 3 and sched.num_drafts(reqs[0]) == 3  # slot 1
    sched.begin_step(reqs)
    assert sched.step_kappa == 1 and sched.num_drafts(reqs[1]) == 1  # slot 8: [0, 1, 3]
    assert sched.current_kappa == 1
    for r in reqs:
        sched.observe_accept(r, 1, 1)
    sched.end_step()
    assert sched.kappa_schedule.states[8].num_steps == 1
    assert sched.kappa_schedule.states[8].ema_accept_len == pytest.approx(0.2)
    # speculation off stays off: a default kappa of 0 is not widened
    sched.num_speculative_tokens = 0
    assert sched.speculative_tokens_for(None) == 0 and sched.speculative_tokens_for(2) == 2


def test_fixed_policy_verifies_every_draft_up_to_kappa():
    sched, reqs = _scheduler("fixed")
    r = reqs[0]
    r.accept_len_ema = 0.0  # drafts failed: the goodput policy's cap would be 1
    sched.begin_step(reqs)
    assert sched.step_kappa is None and sched.num_drafts(r) == 4
    goodput, reqs = _scheduler("goodput")
    reqs[0].accept_len_ema = 0.0
    assert goodput.num_drafts(reqs[0]) == 1


def test_schedule_change_reaches_a_running_request():
    """In-process cluster, schedule policy, one request whose drafts are always right (an
    oracle): at batch 1 it starts at kappa 3, the schedule rises to 7 at its 15th step, and
    the same running request verifies 7 drafts from its next step on; output identical to
    plain decode."""
    import torch
    from helpers.models import tiny_llama
    from helpers.proposers import OracleProposer

    from specmesh.cluster.inprocess import InProcessCluster
    from specmesh.protocol.messages import SamplingParams

    _, model, cfg = tiny_llama(seed=0, dtype=torch.float64, vocab_size=96)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    sp = SamplingParams(max_tokens=120)
    plain = InProcessCluster(model, cfg, num_speculative_tokens=0, num_kv_blocks=64,
                             block_size=4)
    (ref,) = plain.generate([prompt], sp)
    c = InProcessCluster(model, cfg, num_speculative_tokens=4, num_kv_blocks=64, block_size=4,
                         proposer=OracleProposer([prompt], [ref.token_ids]),
                         speculative_policy="schedule")
    steps = []
    run_step = c.verifier.verify_step.run

    def recorded(plan, **kw):
        steps.append((c.verifier.scheduler.step_kappa,
                      [(p.request.request_id, len(p.draft_token_ids)) for p in plan]))
        return run_step(plan, **kw)

    c.verifier.verify_step.run = recorded
    (out,) = c.generate([prompt], sp)
    assert out.token_ids == ref.token_ids
    assert out.spec.num_accepted_tokens == out.spec.num_draft_tokens > 0
    (change,) = c.verifier.scheduler.kappa_schedule.changes
    assert (change.old, change.new, change.batch) == (3, 7, 1)
    kappas = [k for k, _ in steps]
    first7 = kappas.index(7)
    assert set(kappas[:first7]) == {3} and first7 >= 15
    ids = {rid for _, plan in steps for rid, _ in plan}
    assert len(ids) == 1  # one request, running throughout
    drafts = [n for _, plan in steps for _, n in plan]
    assert max(drafts[:first7]) == 3
    # its very next step verifies more than 3 (the drafter had run ahead 2 x 3 = 6 drafts for
    # the kappa its last VerifyCommit asked for), and 7 from the one after
    assert 3 < drafts[first7] <= 7 and drafts[first7 + 1] == 7
    assert c.verifier.scheduler.current_kappa == 7
    # the current kappa is a Prometheus gauge of the verifier, its moves a counter
    import types

    from prometheus_client import CollectorRegistry, generate_latest

    from specmesh.cluster.metrics import RoleCollector

    registry = CollectorRegistry()
    registry.register(RoleCollector(types.SimpleNamespace(
        role="verifier", instance_id="verifier-0", worker=c.verifier)))
    text = generate_latest(registry).decode()
    gauge = next(ln for ln in text.splitlines() if ln.startswith("specmesh:spec_decode_kappa{"))
    assert float(gauge.split()[-1]) == 7.0
    assert 'specmesh:spec_decode_kappa_changes_total{instance="verifier-0",role="verifier"} 1.0' \
        in text
