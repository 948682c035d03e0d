"""M:N on three Ray nodes (``ray.cluster_utils.Cluster``, every node on 127.0.0.1): 2 prefill
workers, 2 verifiers, 2 drafters and a gateway; 16 concurrent greedy requests through the
gateway all equal plain greedy decode (kappa = 0, in process: the output token ids, via
``return_token_ids``), both verifiers and both drafters did work, and drafts were accepted. Then a drafter is
killed for good (``ray.kill``, no restart): the controller's health check deregisters it within
a bound (its missed heartbeats plus a few seconds), both verifiers apply the roster without it, and requests stay exact on the drafter
left.

The Ray driver is a subprocess (tests/multinode/_mn_driver.py): this pytest process may already
be a driver of the embedded Ray of the other tests, and a driver joins one cluster only. The
in-process reference runs here meanwhile.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster.health import HEARTBEAT_INTERVAL_S, MAX_MISSED_BEATS

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DRIVER = HERE / "_mn_driver.py"
TOPICS = ["rivers", "python", "the moon", "tea", "primes", "bikes", "sorting", "volcanoes",
          "poetry", "search", "clouds", "chess", "maps", "bread", "music", "stars"]
PROMPTS = [f"Request {i}: tell me about {t}." for i, t in enumerate(TOPICS)]
MAX_TOKENS = 32
DRIVER_TIMEOUT_S = 240
#: the missed heartbeats that make a role dead, the next health check, the roster push and
#: slack for a loaded machine
LEAVE_BOUND_S = (MAX_MISSED_BEATS + 5) * HEARTBEAT_INTERVAL_S


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_leftovers(root: str) -> None:
    """Processes of the driver's Ray nodes that outlived it (their command lines name the
    per-test temp dir); never anything else."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if root in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


@pytest.fixture(scope="module")
def run(tiny_model_dir):
    """Start the driver, compute the reference meanwhile, return (driver report, reference)."""
    root = tempfile.mkdtemp(prefix="smn-", dir="/tmp")  # short: Unix socket paths
    prompts = Path(root, "prompts.json")
    prompts.write_text(json.dumps(PROMPTS))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    bindir = str(Path(sys.executable).parent)
    env.update(PATH=os.pathsep.join([bindir, env.get("PATH", "")]),
               RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", RAY_USAGE_STATS_ENABLED="0",
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", OMP_WAIT_POLICY="PASSIVE",
               TOKENIZERS_PARALLELISM="false", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(32),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    out_path, err_path = Path(root, "driver.out"), Path(root, "driver.err")
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(DRIVER), tiny_model_dir, str(prompts), str(MAX_TOKENS),
             os.path.join(root, "ray")],
            stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True,
            preexec_fn=_die_with_parent)
    try:
        reference = _reference(tiny_model_dir)
        try:
            rc = proc.wait(timeout=max(DRIVER_TIMEOUT_S - (time.monotonic() - t0), 30))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = "timeout"
        stdout = out_path.read_text(errors="replace")
        if rc != 0:
            stderr = err_path.read_text(errors="replace")
            pytest.fail(f"driver failed ({rc}) after {time.monotonic() - t0:.0f} s:\n"
                        f"{stdout[-3000:]}\n{stderr[-8000:]}")
        report = json.loads(stdout.strip().splitlines()[-1])
        report["wall_s"] = time.monotonic() - t0
        print(f"M:N driver timings: {report['timings']}, wall {report['wall_s']:.0f} s")
        yield report, reference
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_leftovers(root)
        shutil.rmtree(root, ignore_errors=True)


def _reference(model_dir: str) -> dict[str, list[int]]:
    """Plain greedy (kappa = 0) through the in-process workers: prompt -> output token ids."""
    from cluster.inprocess import InProcessCluster
    from engine.loader import load_model
    from protocol.messages import SamplingParams

    loaded = load_model(model_dir, dtype="float32")
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=loaded.config.eos_token_ids)
    tok = loaded.tokenizer
    outs = plain.generate([list(tok(p)["input_ids"]) for p in PROMPTS],
                          SamplingParams(max_tokens=MAX_TOKENS))
    return {p: list(o.token_ids) for p, o in zip(PROMPTS, outs)}


def _delta(report: dict, iid: str, key: str, a: str = "before", b: str = "after") -> int:
    return report[b][iid][key] - report[a][iid][key]


def test_three_nodes_on_loopback_with_roles_spread_over_them(run):
    report, _ = run
    nodes = {n["node_id"]: n for n in report["nodes"]}
    assert len(nodes) == 3 and all(n["ip"] == "127.0.0.1" for n in nodes.values()), nodes
    placed, workers = report["placed"], report["worker_node_ids"]
    for role in ("prefill", "verifier", "drafter"):  # one of each on either worker node
        assert sorted(placed[f"specmesh-{role}-{i}"] for i in range(2)) == sorted(workers)
    (head,) = set(nodes) - set(workers)
    assert placed["specmesh-gateway-0"] == head


def test_sixteen_concurrent_requests_are_exact_and_use_both_verifiers_and_drafters(run):
    report, reference = run
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


def test_a_killed_drafter_leaves_the_roster_and_requests_stay_exact(run):
    report, reference = run
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
