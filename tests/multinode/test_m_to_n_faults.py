"""Issue 9's kill tests through the Ray-managed roles, on the M:N cluster of test_m_to_n.py (one
cluster for both modules: the ``m_to_n`` fixture in conftest.py). After the concurrent requests
and the first drafter's loss, the driver runs the scenarios of tests/multinode/_mn_faults.py in
order: roles join with ``specmesh launch``; a drafter dies under a long request (re-opened on
the other drafter); the last drafter is killed and restarted by Ray (re-synced); it is killed
for good (plain decode, no tail waits); a verifier is killed (its request fails within 10 s, the
other verifier serves); prefill workers are killed mid-transfer (retried on another, then a
clear error within 60 s with none left, KV usage back to zero). Output ids are compared with
plain greedy decode (kappa = 0, in process)."""

from __future__ import annotations

import pytest
from _mn_faults import JOIN_PROMPTS, LONG_PROMPTS, long_prompt

from specmesh.cluster.health import HEARTBEAT_INTERVAL_S, MAX_MISSED_BEATS

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

#: the missed heartbeats that make a role dead, the next health check, the roster push and
#: slack for a loaded machine
LEAVE_BOUND_S = (MAX_MISSED_BEATS + 5) * HEARTBEAT_INTERVAL_S
#: a lost drafter's requests move on after ``drafter_lost_grace_s`` (2 s); slack for a loaded
#: machine
REOPEN_BOUND_S = 10.0
#: the issue's bounds: a dead verifier's requests fail within 10 s, a dead prefill's transfer
#: ends (retried or failed) within 60 s
VERIFIER_LOSS_BOUND_S = 10.0
TRANSFER_BOUND_S = 60.0


@pytest.fixture(scope="module")
def faults(m_to_n):
    report, reference = m_to_n
    return report["faults"], reference


def _scenario(faults, name: str) -> dict:
    got = faults[0][name]
    assert "exception" not in got, f"{name} raised in the driver:\n{got['exception']}"
    return got


def _exact(stream: dict, reference: dict) -> None:
    assert stream["finished"] and stream["error"] is None, stream["error"]
    assert stream["token_ids"] == reference[stream["prompt"]], stream["prompt"]


def test_roles_launched_into_the_running_cluster_join_the_roster_and_get_work(faults):
    f, reference = _scenario(faults, "roles_join"), faults[1]
    assert {"prefill-9", "drafter-9"} <= set(f["roster"])
    assert [e["instance_id"] for e in f["launched"]["prefill"]] == ["prefill-9"]
    for r in f["responses"]:
        assert r["status"] == 200, r
        assert r["token_ids"] == reference[r["prompt"]], r["prompt"]
    assert sorted(r["prompt"] for r in f["responses"]) == sorted(JOIN_PROMPTS)
    assert f["prefill_stats"]["num_requests"] > 0  # the new prefill worker prefilled some
    assert f["drafter_stats"]["num_syncs"] > 0  # and the new drafter drafted for some
    assert f["drafter_stats"]["num_draft_tokens_sent"] > 0


def test_a_request_whose_drafter_dies_is_reopened_on_another_drafter(faults):
    f, reference = _scenario(faults, "drafter_loss_reopen"), faults[1]
    _exact(f["final"], reference)
    assert f["at_kill"]["num_accepted_tokens"] > 0 and f["at_kill"]["drafter"] == f["killed"]
    reopen = f["at_reopen"]
    assert reopen is not None, "the request was not re-opened on the other drafter in flight"
    assert reopen["drafter"] == f["other"]
    assert reopen["num_draft_syncs"] > f["at_kill"]["num_draft_syncs"]  # a DraftSync there
    assert f["reopen_s"] < REOPEN_BOUND_S
    assert f["other_syncs"] >= 1
    # drafts accepted again after the re-open, on the other drafter
    assert f["final"]["spec_stats"]["num_accepted_tokens"] > reopen["num_accepted_tokens"]
    # and the health check deregisters the dead drafter; the verifiers apply the roster
    assert f["left_roster_s"] is not None and f["left_roster_s"] < LEAVE_BOUND_S, \
        (f["left_roster_s"], f["kill_timeline"])
    assert f["peers_updated_s"] is not None
    assert "dead" in f["health"]["removed"][f["killed"]]
    assert f["killed"] not in f["roster_after_kill"] and f["other"] in f["roster_after_kill"]
    print(f"drafter loss: re-opened on {f['other']} {f['reopen_s']:.1f} s after the kill, "
          f"left the roster {f['left_roster_s']:.1f} s")


def test_a_drafter_restarted_by_ray_resyncs_the_request_in_flight(faults):
    """Killed after the first SSE chunk of a long request with accepted drafts (two more in
    flight): every request completes exactly; Ray restarts the drafter (a new incarnation), the
    verifier re-opens the requests there with DraftSync while they run, and they accept drafts
    again. On either kind of hosts: the requests ask for enough tokens to outlive the restart
    (_mn_faults.RESTART_MAX_TOKENS); their output equals the same request served with
    speculation off, whose first LONG_MAX_TOKENS equal plain greedy decode in process."""
    f, reference = _scenario(faults, "drafter_restart"), faults[1]
    plain = f["plain"]  # the same request with speculation off, served alongside
    assert plain["finished"] and plain["error"] is None, plain["error"]
    assert plain["spec_stats"]["num_draft_tokens"] == 0, plain["spec_stats"]
    want = reference[LONG_PROMPTS["restart"]]  # plain greedy in process: the first tokens
    assert plain["token_ids"][:len(want)] == want
    assert len(plain["token_ids"]) > len(want)  # it outlives the other long requests
    for final in f["finals"]:  # every request in flight completes exactly
        assert final["prompt"] == LONG_PROMPTS["restart"]
        assert final["finished"] and final["error"] is None, final["error"]
        assert final["token_ids"] == plain["token_ids"], final["request_id"]
    assert f["at_kill"]["num_accepted_tokens"] > 0 and f["at_kill"]["drafter"] == f["killed"]
    assert f["new_incarnation"] != f["old_incarnation"]
    resync = f["at_resync"]
    assert resync is not None, ("no request was re-synced on the restarted drafter in flight",
                                f["resync_s"], f["ends_after_kill_s"])
    assert resync["drafter"] == f["killed"]
    # the request followed was in flight at the kill (output committed) and at the re-sync
    assert (f["resynced_at_kill"].get("committed_len") or 0) > 0, f["resynced_at_kill"]
    assert resync["committed_len"] < len(f["final"]["token_ids"])
    assert resync["num_draft_syncs"] > f["resynced_at_kill"]["num_draft_syncs"]
    assert f["drafter_stats"]["num_syncs"] >= 1  # the new incarnation got the DraftSync
    assert f["at_accept"] is not None  # accepted drafts grew after the re-sync
    assert f["final"]["spec_stats"]["num_accepted_tokens"] > resync["num_accepted_tokens"]
    print(f"drafter restart: re-synced {f['resync_s']:.1f} s after the kill, at output "
          f"position {resync['committed_len']}; the requests ended {f['ends_after_kill_s']} s "
          "after the kill")


def test_a_drafter_killed_for_good_leaves_plain_decode_without_tail_waits(faults):
    f, reference = _scenario(faults, "drafter_gone"), faults[1]
    _exact(f["final"], reference)
    assert f["at_kill"]["num_accepted_tokens"] > 0
    start, before, settled, end = f["at_start"], f["before"], f["settled"], f["end"]
    # while the drafter lived, steps waited for its tails
    assert before["num_tail_waits"] > start["num_tail_waits"]
    # once it is gone (silent, then lost) no step waits: the waits per step fall to zero
    assert end["num_steps"] - settled["num_steps"] > 0
    assert end["num_tail_waits"] == settled["num_tail_waits"], (settled, end)
    # the request ran on as plain decode past the kill
    assert settled["committed_len"] is not None and settled["committed_len"] < len(
        f["final"]["token_ids"])


def test_a_killed_verifiers_requests_fail_within_10_s_and_the_other_verifier_serves(faults):
    f, reference = _scenario(faults, "verifier_killed"), faults[1]
    failed = f["failed"]
    assert failed["finished"] and failed["error"], failed
    assert f["killed"] in failed["error"]  # the error names the verifier
    assert failed["error_after_kill_s"] < VERIFIER_LOSS_BOUND_S
    _exact(f["survived"], reference)
    again = f["again"]
    assert again["status"] == 200, again
    assert again["token_ids"] == reference[again["prompt"]]
    assert f["kept_finished"] >= 1  # served by the verifier left
    print(f"verifier kill: its request failed {failed['error_after_kill_s']:.1f} s after")


def test_a_prefill_killed_mid_transfer_retries_on_another_then_fails_clearly(faults):
    f, reference = _scenario(faults, "prefill_killed"), faults[1]
    retry, none = f["retry"], f["none"]
    for case in (retry, none):  # killed with frames received and the transfer incomplete
        assert case["at_kill"]["status"] == "prefilling"
        assert case["at_kill"]["transfer_frames"] > 0
        assert case["at_kill"]["prefill_peer"] == case["killed"]
    got = retry["response"]
    assert got["status"] == 200, got
    assert got["token_ids"] == reference[long_prompt("prefill_retry")]
    assert got["after_kill_s"] < TRANSFER_BOUND_S
    assert any(n > 0 for p, n in retry["served"].items() if p != retry["killed"])
    got = none["response"]
    assert got["status"] >= 500 and "prefill" in got["error"], got
    assert got["after_kill_s"] < TRANSFER_BOUND_S
    # nothing is left on the verifiers: KV usage back to zero
    for v, kv in f["kv"].items():
        assert kv["kv_cache_usage"] == 0 and kv["num_free_blocks"] == kv["num_kv_blocks"], v
        assert kv["requests"] == {}, v
    print(f"prefill kill: retried in {retry['response']['after_kill_s']:.1f} s, failed in "
          f"{got['after_kill_s']:.1f} s")
