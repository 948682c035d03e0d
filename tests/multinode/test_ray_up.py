"""``ray up`` for real (issue 39): deploy/cluster-local.yaml, rendered for the session's
namespace hosts (cluster/netns_hosts.py: h0 the head, h1 prefill + verifier, h2 the drafter;
each with its own address, sshd and root home), brings up Ray over SSH and launches the roles
(`specmesh launch`, from the head's start commands); a prompt through the gateway equals plain
greedy decode with drafts accepted; every role runs on the node the config gives it (Ray's
node ids, the roles' advertised addresses, the role's process in that host's PID namespace);
``ray down`` then leaves no process on any host. The namespaces themselves go with the session
fixture, which checks that none is left."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specmesh.cluster.netns_config import render_config

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROMPTS = ["1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,"]
MAX_TOKENS = 24
RAY_UP_TIMEOUT_S = 300
ROLES_TIMEOUT_S = 300
#: every Ray process gone from every host after `ray down` (the workers' after the head's)
DOWN_TIMEOUT_S = 120
#: where the config puts each role: the namespace host (index) of its node
PLACEMENT = {"gateway-0": 0, "prefill-0": 1, "verifier-0": 1, "drafter-0": 2}


def _plain_greedy(model_dir: str, prompts: list[str]) -> dict[str, list[int]]:
    from specmesh.cluster.inprocess import InProcessCluster
    from specmesh.engine.loader import load_model
    from specmesh.protocol.messages import SamplingParams

    loaded = load_model(model_dir, dtype="float32")
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=loaded.config.eos_token_ids)
    outs = plain.generate([list(loaded.tokenizer(p)["input_ids"]) for p in prompts],
                          SamplingParams(max_tokens=MAX_TOKENS))
    return {p: list(o.token_ids) for p, o in zip(prompts, outs)}


def _ns_pid(pid: int) -> int:
    """``pid``'s number in its own (innermost) PID namespace (/proc/PID/status NSpid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


def _ray_processes(hosts, h) -> list[str]:
    """Command lines of the processes on host ``h`` other than its sshd (and its sessions)."""
    out = []
    for pid in hosts.pids(h):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cmd.strip() and not cmd.startswith(("sshd", "/usr/sbin/sshd", "sh -c mount")):
            out.append(cmd)
    return out


@pytest.fixture(scope="module")
def ray_up(netns_hosts, tiny_model_dir, cpu_kernels, tmp_path_factory):
    """``ray up -y`` on the rendered config; yields once the four roles are connected:
    {hosts, config, env, ready (tests/multinode/_probe.py ready, run on the head), url};
    ``ray down -y`` afterwards (its result kept in ``downs``)."""
    hosts = netns_hosts
    tmp = tmp_path_factory.mktemp("ray-up")
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    launch = (f"--model {tiny_model_dir} --dtype float32 --num-speculative-tokens 3 "
              "--kv-cache-mb 32 --max-model-len 1024 --threads 1")
    config = tmp / "cluster.yaml"
    config.write_text(render_config((REPO / "deploy" / "cluster-local.yaml").read_text(),
                                    hosts, str(REPO), sys.prefix, str(token),
                                    cluster_name=f"specmesh-{hosts.tag}", launch_args=launch))
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",
                                                             "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.update(PATH=os.pathsep.join([bindir, env.get("PATH", "")]),
               RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=token.read_text(),
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    ray_cli = str(Path(bindir, "ray"))
    state = {"downs": None}
    try:
        up = subprocess.run([ray_cli, "up", "-y", "--no-config-cache", str(config)], env=env,
                            capture_output=True, text=True, timeout=RAY_UP_TIMEOUT_S,
                            cwd=tmp)
        assert up.returncode == 0, f"ray up failed:\n{up.stdout[-4000:]}\n{up.stderr[-4000:]}"
        head = hosts.hosts[0]
        probe = subprocess.run(
            hosts.argv(head, [sys.executable, str(HERE / "_probe.py"), "ready",
                              f"{head.ip}:6379", str(ROLES_TIMEOUT_S)], wd=str(REPO)),
            env=env, capture_output=True, text=True, timeout=ROLES_TIMEOUT_S + 60)
        launch_log = Path(hosts.home(head), "specmesh-launch.log")
        assert probe.returncode == 0, (
            f"roles not ready:\n{probe.stdout[-2000:]}\n{probe.stderr[-4000:]}\n--- launch log"
            f" ---\n{launch_log.read_text()[-4000:] if launch_log.exists() else '(none)'}")
        ready = json.loads(probe.stdout.strip().splitlines()[-1])
        url = ready["infos"]["gateway-0"]["url"]
        yield {"hosts": hosts, "config": config, "env": env, "ready": ready, "url": url,
               "state": state}
    finally:
        down = subprocess.run([ray_cli, "down", "-y", str(config)], env=env,
                              capture_output=True, text=True, timeout=180, cwd=tmp)
        state["downs"] = down


def test_ray_up_serves_exact_greedy_with_drafts_accepted(ray_up, tiny_model_dir):
    url = ray_up["url"]
    want = _plain_greedy(tiny_model_dir, PROMPTS)
    accepted = 0
    for prompt in PROMPTS:
        r = httpx.post(f"{url}/v1/completions", timeout=180, json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["token_ids"] == want[prompt], prompt
        accepted += got["spec_stats"]["num_accepted_tokens"]
    assert accepted > 0, "no draft accepted: the drafter on h2 is not used"


def test_ray_up_places_each_role_on_the_node_the_config_gives_it(ray_up):
    hosts, ready = ray_up["hosts"], ray_up["ready"]
    nodes = {n["node_id"]: n for n in ready["nodes"]}
    assert sorted(n["ip"] for n in nodes.values()) == sorted(hosts.ips), nodes
    node_of_ip = {n["ip"]: i for i, n in nodes.items()}
    roster = {r["instance_id"]: r for r in ready["roster"]}
    for iid, host_index in PLACEMENT.items():
        h = hosts.hosts[host_index]
        # Ray's view: the actor's node is the node on that host's address
        assert ready["actor_nodes"][f"specmesh-{iid}"] == node_of_ip[h.ip], (iid, h.ip)
        # the role's own view: it binds and advertises that address, with CurveZMQ
        assert roster[iid]["endpoint"].startswith(f"tcp://{h.ip}:"), roster[iid]
        assert roster[iid]["curve"], roster[iid]
        # the OS view: the role's process lives in that host's PID namespace
        pid = ready["infos"][iid]["pid"]
        assert pid in {_ns_pid(p) for p in hosts.pids(h)}, (iid, pid)
    assert ray_up["url"].startswith(f"http://{hosts.hosts[0].ip}:8000")
    for r in roster.values():  # no other address is ever advertised
        assert hosts.in_subnet(r["endpoint"].split("://")[1].rsplit(":", 1)[0]), r


def test_ray_down_leaves_no_process_on_any_host(ray_up):
    """Last test of the module: tears the cluster down itself (the fixture's ``ray down``
    then finds nothing) and checks every host."""
    config, env, hosts = ray_up["config"], ray_up["env"], ray_up["hosts"]
    down = subprocess.run([str(Path(sys.executable).parent / "ray"), "down", "-y", str(config)],
                          env=env, capture_output=True, text=True, timeout=180,
                          cwd=config.parent)
    assert down.returncode == 0, f"{down.stdout[-3000:]}\n{down.stderr[-3000:]}"
    # `ray stop` on the head at once; on the workers (deploy/stop_with_head.sh) once 3 checks
    # 5 s apart found the head gone, and the ray stop itself
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    left = {}
    while time.monotonic() < deadline:
        left = {h.name: _ray_processes(hosts, h) for h in hosts.hosts}
        if not any(left.values()):
            break
        time.sleep(1)
    assert not any(left.values()), {k: [c[:300] for c in v] for k, v in left.items()}
