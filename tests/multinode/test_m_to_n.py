"""M:N on three Ray nodes (``ray.cluster_utils.Cluster``, every node on 127.0.0.1): 2 prefill
workers, 2 verifiers, 2 drafters and a gateway; 16 concurrent greedy requests through the
gateway all equal plain greedy decode (kappa = 0, in process: the output token ids, via
``return_token_ids``), both verifiers and both drafters did work, and drafts were accepted. Then a drafter is
killed for good (``ray.kill``, no restart): the controller's health check deregisters it within
a bound (its missed heartbeats plus a few seconds), both verifiers apply the roster without it, and requests stay exact on the drafter
left.

The driver (tests/multinode/_mn_driver.py) runs in a subprocess, started by the session
fixture ``m_to_n`` (conftest.py, _mn_setup.py), which test_m_to_n_faults.py shares: after these
steps the same cluster goes through issue 9's fault scenarios.
"""

from __future__ import annotations

import pytest
from _mn_setup import DRIVER_TIMEOUT_S, PROMPTS

from specmesh.cluster.health import HEARTBEAT_INTERVAL_S, MAX_MISSED_BEATS

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

#: the missed heartbeats that make a role dead, the next health check, the roster push and
#: slack for a loaded machine
LEAVE_BOUND_S = (MAX_MISSED_BEATS + 5) * HEARTBEAT_INTERVAL_S


def _delta(report: dict, iid: str, key: str, a: str = "before", b: str = "after") -> int:
    return report[b][iid][key] - report[a][iid][key]


def _node_ips(report: dict) -> list[str]:
    """The address each of the 3 nodes must have: 127.0.0.1, or its namespace host's."""
    if report["hosts"] is None:
        return ["127.0.0.1"] * 3
    return [h["ip"] for h in report["hosts"]["hosts"]]


def test_three_nodes_with_roles_spread_over_them(m_to_n):
    report, _ = m_to_n
    nodes = {n["node_id"]: n for n in report["nodes"]}
    assert len(nodes) == 3, nodes
    assert sorted(n["ip"] for n in nodes.values()) == sorted(_node_ips(report)), nodes
    placed, workers = report["placed"], report["worker_node_ids"]
    for role in ("prefill", "verifier", "drafter"):  # one of each on either worker node
        assert sorted(placed[f"specmesh-{role}-{i}"] for i in range(2)) == sorted(workers)
    (head,) = set(nodes) - set(workers)
    assert placed["specmesh-gateway-0"] == head
    # each role advertises the address of the node Ray placed it on
    roster = {r["instance_id"]: r for r in report["roster"]}
    for iid, entry in roster.items():
        ip = nodes[placed[f"specmesh-{iid}"]]["ip"]
        assert entry["endpoint"].startswith(f"tcp://{ip}:"), (iid, entry, ip)
    assert report["gateway_url"].startswith(f"http://{nodes[head]['ip']}:")


@pytest.mark.parametrize("m_to_n", ["netns"], indirect=True)
def test_on_namespace_hosts_every_endpoint_is_in_their_subnet_and_traffic_crossed_the_veths(
        m_to_n):
    """Issue 39: roles bind and advertise their own host's address (never 127.0.0.1, never a
    wildcard; also those launched into the running cluster and a role Ray restarted), every
    link runs CurveZMQ (``auto``: the roles are off the loopback), and the
    role-to-role traffic crossed each host's veth link both ways (its interface counters)."""
    report, _ = m_to_n
    from specmesh.cluster.netns_hosts import NetnsHosts

    hosts = NetnsHosts.load_description(report["hosts"])
    addresses = [n["ip"] for n in report["nodes"]] + [report["gateway_url"]]
    for r in report["roster"]:
        addresses.append(r["endpoint"])
        assert r["curve"] and len(r["curve_key"]) == 40, r
    # and so do the roles that joined later (``specmesh launch``) and a role Ray restarted
    faults = report["faults"]
    launched = [e for es in faults["roles_join"]["launched"].values() for e in es]
    assert len(launched) == 2, faults["roles_join"]
    addresses += [e["endpoint"] for e in launched]
    addresses.append(faults["drafter_restart"]["new_endpoint"])
    for a in addresses:
        ip = a.split("://")[-1].rsplit(":", 1)[0]
        assert hosts.in_subnet(ip), (a, hosts.subnet)
    before, after = report["counters"]["before"], report["counters"]["after"]
    for name in ("h0", "h1", "h2"):  # rx on the bridge side: what the host sent, tx: received
        sent = after[name]["rx_bytes"] - before[name]["rx_bytes"]
        got = after[name]["tx_bytes"] - before[name]["tx_bytes"]
        assert sent > 100_000 and got > 100_000, (name, sent, got)


def test_sixteen_concurrent_requests_are_exact_and_use_both_verifiers_and_drafters(m_to_n):
    report, reference = m_to_n
    results = report["results"]
    assert len(results) == len(PROMPTS) == 16
    for r in results:
        assert r["token_ids"] == reference[r["prompt"]], r["prompt"]
        assert r["completion_tokens"] == len(r["token_ids"]), r["prompt"]
    for v in ("verifier-0", "verifier-1"):
        assert _delta(report, v, "num_finished") > 0, v
        assert _delta(report, v, "num_generated_tokens") > 0, v
    assert sum(_delta(report, v, "num_finished") for v in ("verifier-0", "verifier-1")) == 16
    for d in ("drafter-0", "drafter-1"):
        assert _delta(report, d, "num_syncs") > 0, d
        assert _delta(report, d, "num_draft_tokens_sent") > 0, d
    accepted = sum(r["spec_stats"]["num_accepted_tokens"] for r in results)
    assert accepted > 0
    assert sum(_delta(report, v, "num_accepted_tokens")
               for v in ("verifier-0", "verifier-1")) >= accepted
    # the gateway routes with the verifiers' KV room and queues, from their heartbeats
    loads = report["after"]["gateway-0"]["verifier_loads"]
    assert set(loads) == {"verifier-0", "verifier-1"}
    assert all(load["num_free_blocks"] > 0 for load in loads.values()), loads


def test_a_killed_drafter_leaves_the_roster_and_requests_stay_exact(m_to_n):
    report, reference = m_to_n
    assert report["left_roster_s"] is not None and report["left_roster_s"] < LEAVE_BOUND_S, \
        (report["left_roster_s"], report["kill_timeline"])
    assert report["peers_updated_s"] is not None  # both verifiers dropped their connection
    assert "dead" in report["health"]["removed"]["drafter-1"]
    assert sorted(report["roster_after_kill"]) == [
        "drafter-0", "gateway-0", "prefill-0", "prefill-1", "verifier-0", "verifier-1"]
    for r in report["again"]:
        assert r["token_ids"] == reference[r["prompt"]], r["prompt"]
    assert _delta(report, "drafter-0", "num_syncs", "after", "final") >= len(report["again"])
    assert report["wall_s"] < DRIVER_TIMEOUT_S
    print(f"M:N: kill -> left the roster {report['left_roster_s']:.1f} s, verifiers updated "
          f"{report['peers_updated_s']:.1f} s")
