"""The verify forward's threads while a prefill on the same cores is in flight
(decode/core_sharing.py) and how the verifier host decides that prefill shares its cores."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specmesh.cluster.hosts.verifier import VerifierHost, endpoint_host
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.decode.core_sharing import CoreSharing
from specmesh.decode.goodput import DraftBudget
from helpers.models import tiny_llama
from specmesh.protocol.messages import SamplingParams, TokenStream

PROMPTS = [[5, 6, 7, 8, 5, 6], [9, 9, 9, 9], [12, 13, 14], [3, 4, 3, 4, 3]]
SP = SamplingParams(max_tokens=12)


def test_one_thread_only_while_shared_and_a_prefill_is_in_flight():
    calls: list[int] = []
    cs = CoreSharing(4, calls.append, shared=True)
    assert [cs.before_forward(n) for n in (0, 2, 1, 1, 0, 0, 3)] == [4, 1, 1, 1, 4, 4, 1]
    assert calls == [1, 4, 1]  # set only on a change
    assert cs.num_switches == 3
    alone = CoreSharing(4, calls.append)  # prefill elsewhere: the plan's threads always
    assert alone.threads_for(5) == 4 and alone.before_forward(5) == 4


def test_threads_must_be_positive():
    with pytest.raises(ValueError, match="threads must be >= 1"):
        CoreSharing(0, lambda n: None)


#: the verifier steps beside prefills in flight, and prefill runs one prompt per forward
SIDE_BY_SIDE = {"max_prefill_pause_s": 0.0, "prefill_options": {"max_batch_tokens": 1}}


def test_the_verifier_yields_cores_during_the_ramp_and_output_is_unchanged():
    """Four prompts at once, no pause for prefill, one prompt per prefill forward: prefill runs
    them one per turn, so the first steps run while others still await KV (one thread), the
    rest with the plan's threads; tokens identical."""
    _, m, cfg = tiny_llama(seed=3, dtype=torch.float64, vocab_size=64)
    want = [c.token_ids for c in InProcessCluster(m, cfg, num_speculative_tokens=3,
                                                  num_kv_blocks=64, block_size=4)
            .generate(PROMPTS, SP)]
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=64, block_size=4,
                         **SIDE_BY_SIDE)
    calls: list[int] = []
    c.verifier.core_sharing = CoreSharing(2, calls.append, shared=True)
    got = [r.token_ids for r in c.generate(PROMPTS, SP)]
    assert got == want
    assert calls[0] == 1 and calls[-1] == 2  # yielded during the ramp, then back


def _flags(c: InProcessCluster) -> list[bool]:
    """Record the verifier_idle flag of every PrefillRequest the prefill worker gets."""
    seen: list[bool] = []
    handle = c.prefill.handle

    def recording(env):  # noqa: ANN001, ANN202
        if type(env.msg).__name__ == "PrefillRequest":
            seen.append(env.msg.verifier_idle)
        return handle(env)

    c.prefill.handle = recording
    return seen


def _shared_cores_cluster(**options) -> tuple[list[list[int]], InProcessCluster, list[int]]:
    """Plain decode's tokens for PROMPTS, and a cluster (``options``) whose verifier shares its
    2 cores with prefill, the prefill worker's thread changes recorded in the list returned."""
    _, m, cfg = tiny_llama(seed=3, dtype=torch.float64, vocab_size=64)
    want = [c.token_ids for c in InProcessCluster(m, cfg, num_speculative_tokens=3,
                                                  num_kv_blocks=64, block_size=4)
            .generate(PROMPTS, SP)]
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=64, block_size=4,
                         **options)
    c.verifier.core_sharing = CoreSharing(2, lambda n: None, shared=True)
    threads: list[int] = []
    c.prefill.idle_threads = (1, 2, threads.append)
    return want, c, threads


def test_a_prompt_the_verifier_waits_on_idle_runs_on_its_cores_too():
    """Without the pause for prefill: one request at a time, the verifier has nothing to do
    while its prompt prefills: the PrefillRequest says so and the prefill worker runs it on the
    idle threads, then goes back. Several at once: only the first (nothing running, nothing
    else in flight) is marked."""
    want, c, threads = _shared_cores_cluster(**SIDE_BY_SIDE)
    flags = _flags(c)
    one_by_one = [c.generate([p], SP)[0].token_ids for p in PROMPTS]
    assert one_by_one == want
    assert flags == [True] * 4 and threads == [2, 1] * 4
    assert c.prefill.profile.counters["num_prefills_on_idle_verifier_cores"] == 4
    flags.clear()
    threads.clear()
    assert [r.token_ids for r in c.generate(PROMPTS, SP)] == want
    assert flags == [True, False, False, False] and threads == [2, 1]

    c.verifier.core_sharing.shared = False  # prefill on other cores: never marked
    flags.clear()
    c.generate(PROMPTS[:1], SP)
    assert flags == [False]


def test_with_the_pause_every_prompt_runs_on_the_verifiers_cores():
    """With the pause for prefill (the default), the verifier computes nothing while a prompt
    prefills, so every PrefillRequest is marked; every batch of the four runs on the idle
    threads, then goes back; tokens identical."""
    want, c, threads = _shared_cores_cluster()
    flags = _flags(c)
    assert [r.token_ids for r in c.generate(PROMPTS, SP)] == want
    batches = c.prefill.profile.counters["num_batches"]
    assert flags == [True] * 4 and threads == [2, 1] * batches and batches < 4
    assert c.prefill.profile.counters["num_batch_prompts"] == 4


class _Worker:
    def __init__(self) -> None:
        self.core_sharing = CoreSharing(2, lambda n: None)
        self.scheduler = SimpleNamespace(draft_budget=DraftBudget())

    def set_roster(self, prefill, drafters) -> None:
        self.roster = (prefill, drafters)


def _host(on_cpu: bool) -> VerifierHost:
    host = object.__new__(VerifierHost)  # only what apply_roster reads
    host._on_cpu, host.advertise_host, host.worker = on_cpu, "10.0.0.5", _Worker()
    host.connect_only = lambda peers: None
    return host


def _prefill(host: str) -> dict:
    return {"instance_id": f"prefill-{host}", "role": "prefill", "incarnation": 1,
            "endpoint": f"tcp://{host}:5555"}


@pytest.mark.parametrize("on_cpu, prefill_hosts, shared", [
    (True, ["10.0.0.5"], True),  # same node, CPU: shared cores
    (True, ["10.0.0.7", "10.0.0.5"], True),
    (True, ["10.0.0.7"], False),  # prefill on another node
    (False, ["10.0.0.5"], False),  # the verifier computes on a GPU
    (True, [], False),
])
def test_the_host_marks_cores_shared_by_a_prefill_on_its_node_and_cpu(on_cpu, prefill_hosts,
                                                                        shared):
    host = _host(on_cpu)
    host.apply_roster([_prefill(h) for h in prefill_hosts])
    assert host.worker.core_sharing.shared is shared


def _drafter(host: str) -> dict:
    return {"instance_id": f"drafter-{host}", "role": "drafter", "incarnation": 1,
            "endpoint": f"tcp://{host}:6666"}


@pytest.mark.parametrize("on_cpu, drafter_hosts, shared", [
    (True, ["10.0.0.5"], True),  # same node, CPU: the drafts cost the verifier's cores
    (True, ["10.0.0.7"], False),  # drafter on another node
    (False, ["10.0.0.5"], False),  # the verifier computes on a GPU
])
def test_the_host_marks_a_drafter_on_its_cores_for_the_goodput_cost(on_cpu, drafter_hosts,
                                                                   shared):
    host = _host(on_cpu)
    host.apply_roster([_drafter(h) for h in drafter_hosts])
    assert host.worker.scheduler.draft_budget.drafter_shared is shared
    assert host.worker.core_sharing.shared is False  # no prefill there


def test_endpoint_host():
    assert endpoint_host("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert endpoint_host("tcp://[::1]:5555") == "::1"
    assert endpoint_host("not an endpoint") == ""


def test_the_pause_figures_count_the_tokens_a_prefill_computed_not_its_cache_hits():
    """A prompt whose leading blocks the prefix cache held is observed by the tokens its
    prefill computed (a hit costs the forward nothing), and the count reaches the stream."""
    _, m, cfg = tiny_llama(seed=3, dtype=torch.float64, vocab_size=64)
    c = InProcessCluster(m, cfg, num_speculative_tokens=3, num_kv_blocks=64, block_size=4)
    c.verifier.core_sharing = CoreSharing(2, lambda n: None, shared=True)
    seen: list[tuple[bool, int]] = []
    c.verifier.prefill_pause.observe = lambda paused, n, s: seen.append((paused, n))
    prompt = [5, 6, 7, 8, 5, 6, 9, 9, 9, 9, 3]  # 11 tokens: 2 full blocks of 4 cacheable
    streams: list[TokenStream] = []
    drain = c.client.drain

    def recording_drain():
        envs = drain()
        streams.extend(e.msg for e in envs if isinstance(e.msg, TokenStream))
        return envs

    c.client.drain = recording_drain
    first = c.generate([prompt], SP)[0]
    cold = {s.num_cached_tokens for s in streams}
    streams.clear()
    again = c.generate([prompt], SP)[0]
    assert again.token_ids == first.token_ids
    assert seen == [(True, 11), (True, 3)]  # idle verifier: counted as paused
    assert cold == {0} and {s.num_cached_tokens for s in streams} == {8}


@pytest.mark.parametrize("free, boosted", [(2, True), (None, True), (1, False), (0, False)])
def test_the_idle_threads_are_taken_only_as_far_as_the_cpus_are_free(free, boosted):
    """Another process busy on one of 2 cores (a benchmark client): a team of 2 threads would
    stall at every barrier, so a prompt the idle verifier waits on stays on the prefill's own
    thread; with the cores free (or nothing known) it takes the verifier's. Tokens identical."""
    want, c, threads = _shared_cores_cluster()
    c.prefill.free_cpus = lambda: free
    assert [c.generate([p], SP)[0].token_ids for p in PROMPTS] == want
    assert threads == ([2, 1] * 4 if boosted else [])
    assert c.prefill.profile.counters.get("num_prefills_on_idle_verifier_cores", 0) == (
        4 if boosted else 0)
    assert c.prefill.profile.counters.get("num_prefills_idle_cores_busy", 0) == (
        0 if boosted else 4)
