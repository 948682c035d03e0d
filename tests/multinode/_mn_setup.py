"""Runs tests/multinode/_mn_driver.py (the M:N cluster, its requests and fault scenarios) in a
subprocess and computes the plain greedy reference meanwhile; shared by test_m_to_n.py and
test_m_to_n_faults.py through the session fixture ``m_to_n`` (conftest.py): one cluster.

The Ray driver is a subprocess: this pytest process may already be a driver of the embedded Ray
of the other tests, and a driver joins one cluster only.
"""

from __future__ import annotations

import ctypes
import functools
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
from _mn_faults import compared_requests

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DRIVER = HERE / "_mn_driver.py"
TOPICS = ["rivers", "python", "the moon", "tea", "primes", "bikes", "sorting", "volcanoes",
          "poetry", "search", "clouds", "chess", "maps", "bread", "music", "stars"]
PROMPTS = [f"Request {i}: tell me about {t}." for i, t in enumerate(TOPICS)]
MAX_TOKENS = 32
#: output tokens of the fault scenarios' long requests (the drafter-restart ones ask for more:
#: _mn_faults.RESTART_MAX_TOKENS)
LONG_MAX_TOKENS = 1800
#: the driver's whole run: cluster start, requests, the drafter loss, the fault scenarios
DRIVER_TIMEOUT_S = 600


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


def run_driver(tiny_model_dir: str, hosts=None):
    """Start the driver, compute the reference meanwhile, yield (driver report, reference:
    prompt -> plain greedy output ids, for the M:N requests and the fault scenarios').

    ``hosts`` (cluster.netns_hosts.NetnsHosts): the Ray nodes run on those namespace hosts
    (head on host 0, the two worker nodes on hosts 1 and 2; _netns_ray.py) and the driver on
    host 0; the report then also has ``hosts`` (their description) and ``counters`` (each
    host's veth byte counters before and after). None: the loopback cluster.

    Raises:
        pytest.fail.Exception: the driver failed or timed out (its output in the message).
    """
    root = tempfile.mkdtemp(prefix="smn-", dir="/tmp")  # short: Unix socket paths
    prompts = Path(root, "prompts.json")
    prompts.write_text(json.dumps(PROMPTS))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    bindir = str(Path(sys.executable).parent)
    env.update(PATH=os.pathsep.join([bindir, env.get("PATH", "")]),
               RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", RAY_USAGE_STATS_ENABLED="0",
               OMP_WAIT_POLICY="PASSIVE",
               TOKENIZERS_PARALLELISM="false", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(32),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    if hosts is None:
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every Ray process on 127.0.0.1
    else:  # real interfaces: Ray resolves each node's own address
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    argv = [sys.executable, str(DRIVER), tiny_model_dir, str(prompts), str(MAX_TOKENS),
            os.path.join(root, "ray"), str(LONG_MAX_TOKENS)]
    nodes = counters = None
    t0 = time.monotonic()
    out_path, err_path = Path(root, "driver.out"), Path(root, "driver.err")
    proc = None
    try:
        if hosts is not None:
            from _netns_ray import NetnsRayCluster  # imports ray: the namespace hosts only

            roles = {r: 1 for r in ("prefill", "verifier", "drafter")}
            os.makedirs(os.path.join(root, "ray"))
            counters = hosts.counters()
            nodes = NetnsRayCluster(hosts, os.path.join(root, "ray"), {"gateway": 1},
                                    [{**roles, f"mn-{i}": 1} for i in range(2)], env)
            Path(root, "nodes.json").write_text(json.dumps(
                {"address": nodes.address, "worker_ips": nodes.worker_ips}))
            argv = hosts.argv(hosts.hosts[0], [*argv, str(Path(root, "nodes.json"))],
                              wd=str(REPO))
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=REPO,
                                    start_new_session=True, preexec_fn=_die_with_parent)
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
        after = hosts.counters() if hosts is not None else None
        if nodes is not None:  # the driver is done with them: free the machine for the tests
            logs = nodes.logs()
            nodes.shutdown()
        stdout = out_path.read_text(errors="replace")
        if rc != 0:
            stderr = err_path.read_text(errors="replace")
            pytest.fail(f"driver failed ({rc}) after {time.monotonic() - t0:.0f} s:\n"
                        f"{stdout[-3000:]}\n{stderr[-8000:]}"
                        + (f"\n{logs}" if nodes is not None else ""))
        report = json.loads(stdout.strip().splitlines()[-1])
        report["wall_s"] = time.monotonic() - t0
        report["hosts"] = hosts.describe() if hosts is not None else None
        if hosts is not None:
            report["counters"] = {"before": counters, "after": after}
        print(f"M:N driver timings: {report['timings']}, wall {report['wall_s']:.0f} s")
        yield report, reference
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if nodes is not None:
            nodes.shutdown()
        _kill_leftovers(root)
        shutil.rmtree(root, ignore_errors=True)


@functools.lru_cache(maxsize=2)
def _reference(model_dir: str) -> dict[str, list[int]]:
    """Plain greedy (kappa = 0) through the in-process workers, every prompt with the
    max_tokens the driver uses for it: prompt -> output token ids (computed once per session:
    the loopback and namespace runs compare with the same)."""
    from specmesh.cluster.inprocess import InProcessCluster
    from specmesh.engine.loader import load_model
    from specmesh.protocol.messages import SamplingParams

    loaded = load_model(model_dir, dtype="float32")
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=loaded.config.eos_token_ids)
    tok = loaded.tokenizer
    out = {}
    for max_tokens, prompts in {MAX_TOKENS: PROMPTS,
                                **compared_requests(LONG_MAX_TOKENS)}.items():
        outs = plain.generate([list(tok(p)["input_ids"]) for p in prompts],
                              SamplingParams(max_tokens=max_tokens))
        out.update({p: list(o.token_ids) for p, o in zip(prompts, outs)})
    return out
