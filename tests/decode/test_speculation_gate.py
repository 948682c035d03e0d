"""The speculation gate (decode/speculation_gate.py): drafting on or off per batch-size bucket,
on committed tokens per second measured in windows, with probes of the slower state whose
period doubles while it keeps losing. Its effect on the scheduler: tests/decode/
test_scheduler.py; on the drafter: tests/drafter/test_drafter_worker.py."""

from __future__ import annotations

import pytest

from specmesh.decode.speculation_gate import (
    MAX_PERIOD,
    MIN_PERIOD,
    ON_MARGIN,
    PROBE_BUDGET,
    SETTLE_STEPS,
    WINDOW_STEPS,
    SpeculationGate,
    bucket,
)


def run(gate: SpeculationGate, batch: int, rate: dict[bool, float], steps: int) -> list[bool]:
    """``steps`` steps of ``batch`` requests committing ``rate[on]`` tokens a second (one
    second per step); the states the gate chose, in order."""
    seen = []
    for _ in range(steps):
        on = gate.begin(batch)
        seen.append(on)
        gate.end(batch, int(rate[on]), 1.0)
    return seen


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_measures_both_states_then_keeps_the_faster():
    lines = []
    gate = SpeculationGate(log=lines.append)
    seen = run(gate, 4, {True: 75, False: 100}, 200)
    first = WINDOW_STEPS  # on first, one window
    assert seen[:first] == [True] * first
    off_from = seen.index(False)
    assert off_from == first
    # then off for its settle steps and one window, and it stays off (the faster)
    assert all(not s for s in seen[off_from:off_from + SETTLE_STEPS + WINDOW_STEPS + 5])
    assert gate.on is False
    snap = gate.snapshot()["buckets"]["4"]
    assert snap["tokens_per_s_on"] == pytest.approx(75)
    assert snap["tokens_per_s_off"] == pytest.approx(100)
    assert any("drafting off at batch 4" in ln for ln in lines)


def test_probes_the_slower_state_less_often_while_it_keeps_losing():
    gate = SpeculationGate()
    seen = run(gate, 4, {True: 75, False: 100}, 4000)
    probes = gate.stats.num_probes
    assert probes >= 3
    # the share of steps spent on the slower state once settled is small
    tail = seen[2000:]
    assert tail.count(True) / len(tail) < 0.05
    snap = gate.snapshot()["buckets"]["4"]
    assert snap["probe_period_steps"] == MAX_PERIOD


def test_a_probe_that_wins_takes_over():
    gate = SpeculationGate()
    run(gate, 2, {True: 75, False: 100}, 100)
    assert gate.on is False
    # (it lost by 25 %: the next probe waits for the probe budget, ~250 steps)
    seen = run(gate, 2, {True: 200, False: 100}, 800)
    assert gate.on is True and seen[-1] is True
    assert seen.count(True) > len(seen) / 2  # it stayed on after the probe that won


def test_each_bucket_keeps_its_own_choice():
    gate = SpeculationGate()
    run(gate, 1, {True: 120, False: 80}, 60)  # batch 1: drafting pays
    run(gate, 16, {True: 150, False: 200}, 60)  # batch 16: it does not
    assert gate.begin(16) is False
    gate.end(16, 200, 1.0)
    for _ in range(SETTLE_STEPS + 1):  # back at batch 1: its own faster state
        on = gate.begin(1)
        gate.end(1, 120 if on else 80, 1.0)
    assert on is True


def test_settle_steps_are_not_measured():
    gate = SpeculationGate()
    run(gate, 4, {True: 100, False: 100}, WINDOW_STEPS)  # on measured at 100
    # the switch to off: its first SETTLE_STEPS steps are slow (the drafter going quiet)
    for i in range(SETTLE_STEPS + WINDOW_STEPS):
        assert gate.begin(4) is False
        gate.end(4, 1 if i < SETTLE_STEPS else 120, 1.0)
    assert gate.snapshot()["buckets"]["4"]["tokens_per_s_off"] == pytest.approx(120)


def test_drafting_must_win_by_the_margin():
    """A tie within ON_MARGIN goes to no drafting (what a switch costs falls on drafting's
    side); a clear win keeps drafting on."""
    gate = SpeculationGate()
    run(gate, 4, {True: 100 * (1 + ON_MARGIN / 2), False: 100}, 100)
    assert gate.on is False
    gate = SpeculationGate()
    run(gate, 4, {True: 100 * (1 + 3 * ON_MARGIN), False: 100}, 100)
    assert gate.on is True


def test_a_batch_in_another_bucket_takes_its_choice_at_once():
    """The batch moved (requests finished or arrived): the step takes the new bucket's known
    choice at once, not after the settle steps and the window of the switch it just made."""
    gate = SpeculationGate()
    at_1, at_16 = {True: 80, False: 120}, {True: 200, False: 150}
    run(gate, 1, at_1, 60)  # batch 1: drafting does not pay
    run(gate, 16, at_16, 60)  # batch 16: it does
    run(gate, 1, at_1, 60)
    assert gate.on is False
    assert run(gate, 16, at_16, 1) == [True]  # a switch: settle steps, then a window owed
    assert run(gate, 1, at_1, 1) == [False]  # yet batch 1's choice applies at once


def test_a_probe_that_lost_badly_waits_for_the_probe_budget():
    """A state that lost by half is tried again only after ~(settle + window) * 0.5 /
    PROBE_BUDGET steps, not after MIN_PERIOD: its probes cost ~1 % of the throughput."""
    gate = SpeculationGate()
    seen = run(gate, 16, {True: 50, False: 100}, 1200)
    first_off = seen.index(False)
    probes = [i for i in range(first_off + 1, len(seen)) if seen[i] and not seen[i - 1]]
    wait = int((SETTLE_STEPS + WINDOW_STEPS) * 0.5 / PROBE_BUDGET)
    assert probes and probes[0] - first_off >= wait > MIN_PERIOD
    assert seen[first_off:].count(True) / len(seen[first_off:]) < 0.03


def test_a_bucket_infers_its_first_choice_from_its_neighbours():
    """Drafting measured slower at batch 4 is not tried first at batch 16 (larger batches
    gain less from it); measured faster at batch 16, it is not turned off first at batch 4.
    The inferred bucket still measures the other state at its first probe."""
    gate = SpeculationGate()
    run(gate, 4, {True: 60, False: 100}, 60)
    assert run(gate, 16, {True: 60, False: 100}, 1) == [False]
    snap = gate.snapshot()["buckets"]["16"]
    assert snap["tokens_per_s_on"] is None  # never tried there
    gate = SpeculationGate()
    run(gate, 16, {True: 150, False: 100}, 60)
    assert run(gate, 4, {True: 150, False: 100}, 1) == [True]
    seen = run(gate, 4, {True: 150, False: 100}, MIN_PERIOD + 40)
    assert False in seen  # the probe of the state it skipped
    assert gate.snapshot()["buckets"]["4"]["tokens_per_s_off"] is not None
