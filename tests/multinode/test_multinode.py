"""Two Ray nodes on 127.0.0.1, roles joined with deploy/launch_roles.sh (``specmesh launch``):
the head node offers the ``prefill``, ``verifier`` and ``gateway`` resources, a second node only
``drafter``. The output token ids through the gateway (``return_token_ids``) equal plain greedy
decode's with drafts accepted, and the drafter runs on the second node. Every role-to-role link
runs CurveZMQ (``--secure-transport``; protocol/curve.py), the keys handed out with the roster.

The roles are launched as deploy/README.md's flow had them fail: prefill, drafter and verifier
with ``--dtype float32``, the gateway afterwards without ``--dtype``; it follows the dtype the
controller settled at the first launch (on an AVX-512 BF16 host its own ``auto`` once gave
bfloat16, and the verifier refused its Hello while requests waited).

The nodes are ``ray start --block`` processes with their own temp dirs and ports, so they do
not touch the embedded Ray that the other tests share (``ray_session``); teardown terminates
exactly those processes (never ``ray stop``, which would stop every Ray on the machine). Every
Ray call runs in a subprocess (``_probe.py``, the launch script): this pytest process may
already be a driver of the embedded Ray, and a driver joins one cluster only.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from specmesh.gateway.tokens import chat_prompt_ids

pytestmark = [pytest.mark.ray, pytest.mark.multinode]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PROBE = HERE / "_probe.py"
RAY_START = HERE / "_ray_start.py"
#: plain greedy on the tiny model repeats itself after the second and third (drafts accepted)
PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "Count: 1, 2, 3, 4, 5,"]
MAX_TOKENS = 24
#: ``--secure-transport``: CurveZMQ between the roles although they bind 127.0.0.1 (``auto``
#: would leave loopback links plain), as on a real multi-node cluster
ROLE_ARGS = ["--model", None, "--dtype", "float32", "--num-speculative-tokens", "3",
             "--kv-cache-mb", "32", "--max-model-len", "1024", "--threads", "1",
             "--secure-transport"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when this pytest process dies (Linux), so a killed
    test run leaves no Ray node behind (`ray start --block` then stops its own processes)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _ancestors(pid: int) -> list[int]:
    """``pid``'s parent chain (Linux /proc)."""
    chain = []
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: ppid
        chain.append(pid)
    return chain


def _pids_using(path: str) -> list[int]:
    """Processes whose command line mentions ``path`` (the per-test Ray temp dir)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if path in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(entry.name))
            except OSError:
                pass
    return out


class TwoNodeRay:
    """A head and a worker node started with ``ray start --block`` in their own sessions."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="smn-", dir="/tmp")  # short: Unix socket paths
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        bindir = str(Path(sys.executable).parent)
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(PATH=os.pathsep.join([bindir, self.env.get("PATH", "")]),
                        RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", RAY_USAGE_STATS_ENABLED="0",
                        # every Ray process answers 127.0.0.1 as its address (_ray_start.py)
                        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
                        OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false",
                        # a head node turns token auth on when ~/.ray/auth_token exists (the
                        # embedded Ray writes one), a worker node does not: give nodes and
                        # drivers one token of our own
                        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        temp = os.path.join(self.root, name)
        cmd = [sys.executable, str(RAY_START), "--block", "--node-ip-address=127.0.0.1",
               "--num-cpus=1", f"--temp-dir={temp}",
               f"--dashboard-agent-listen-port={_free_port()}", "--object-store-memory=100000000",
               "--disable-usage-stats", *args]
        log = open(os.path.join(self.root, f"{name}.log"), "wb")  # noqa: SIM115
        env = {**self.env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # SIGTERM: stop now
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=self.root,
                                preexec_fn=_die_with_parent)
        log.close()
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        head = self._start("head", [
            "--head", f"--port={self.port}", "--include-dashboard=false",
            '--resources={"prefill": 1, "gateway": 1, "verifier": 1}'])
        try:
            _wait_port(self.port, head, 60)
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"{err}\n{self.logs()}") from None
        self._start("worker", [f"--address={self.address}", '--resources={"drafter": 1}'])

    @property
    def head_pid(self) -> int:
        return self.procs[0].pid

    @property
    def worker_pid(self) -> int:
        return self.procs[1].pid

    def run(self, cmd: list[str], timeout: float, **env) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env={**self.env, **env}, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO, preexec_fn=_die_with_parent)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}\n{self.logs()}")
        return proc

    def probe(self, *args: str, timeout: float = 120) -> dict:
        out = self.run([sys.executable, str(PROBE), args[0], self.address, *args[1:]], timeout)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def logs(self) -> str:
        parts = []
        for name in ("head", "worker"):
            p = Path(self.root, f"{name}.log")
            if p.exists():
                parts.append(f"--- ray start ({name}) ---\n{p.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        # worker node first, then the head; SIGTERM lets `ray start --block` stop its processes
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
            try:  # anything left in the session it led (raylet, gcs_server, workers)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in _pids_using(self.root):  # workers that left the session, if any
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def multinode(tiny_model_dir, cpu_kernels):  # the kernel cache warm before roles start
    cluster = TwoNodeRay()
    try:
        cluster.start()
        nodes = cluster.probe("nodes", "60")["nodes"]
        args = [tiny_model_dir if a is None else a for a in ROLE_ARGS]
        launch = ["bash", str(REPO / "deploy" / "launch_roles.sh")]
        env = {"RAY_ADDRESS": cluster.address, "GATEWAY_PORT": "0",
               "SPECMESH": f"{sys.executable} -m specmesh.cluster.cli"}
        roles = cluster.run([*launch, *args], timeout=240, ROLES="prefill drafter verifier",
                            **env)
        i = args.index("--dtype")
        gateway = cluster.run([*launch, *args[:i], *args[i + 2:]], timeout=240,
                              ROLES="gateway", **env)
        infos = [json.loads(line) for out in (roles, gateway) for line in out.stdout.splitlines()
                 if line.startswith("{")]
        ready = cluster.probe("ready", "90")
        url = next(i["url"] for i in infos if i["role"] == "gateway")
        yield {"cluster": cluster, "nodes": nodes, "launched": infos, "ready": ready,
               "url": url, "gateway_stderr": gateway.stderr}
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Plain greedy (kappa = 0) through the in-process workers."""
    from specmesh.cluster.inprocess import InProcessCluster
    from specmesh.engine.loader import load_model
    from specmesh.protocol.messages import SamplingParams

    loaded = load_model(tiny_model_dir, dtype="float32")
    plain = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=0,
                             eos_token_ids=loaded.config.eos_token_ids)

    def run(prompt_ids: list[int]) -> list[int]:
        """Plain greedy's output token ids."""
        (out,) = plain.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS))
        return list(out.token_ids)

    return loaded.tokenizer, run


def _stream_ids(url: str, body: dict) -> list[int]:
    ids: list[int] = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    ids += choice.get("token_ids") or []
    return ids


def test_http_equals_plain_greedy_across_nodes(multinode, reference):
    tok, run = reference
    url = multinode["url"]
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    accepted = 0
    for prompt in PROMPTS:
        want = run(list(tok(prompt)["input_ids"]))
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["token_ids"] == want, prompt
        assert got["usage"]["completion_tokens"] == len(want)
        accepted += got["spec_stats"]["num_accepted_tokens"]
    assert accepted > 0, "no draft accepted: the drafter on the second node is not used"
    assert _stream_ids(url, {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                             "return_token_ids": True}) == run(list(tok(PROMPTS[0])["input_ids"]))
    messages = [{"role": "user", "content": "Name three colors."}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == run(chat_prompt_ids(tok, messages))


def test_a_gateway_launched_without_dtype_follows_the_settled_one(multinode):
    """deploy/README.md's flow: the gateway, launched without ``--dtype`` after roles given
    ``--dtype float32``, took the controller's float32 (its banner says so) and is ready."""
    assert "[specmesh] dtype float32: settled by the cluster's controller" in \
        multinode["gateway_stderr"], multinode["gateway_stderr"]
    assert multinode["ready"]["health"]["gateway-0"]["ready"]  # its Hello was accepted


def test_drafter_runs_on_the_second_node(multinode):
    ready, cluster = multinode["ready"], multinode["cluster"]
    nodes = {n["node_id"]: n for n in ready["nodes"]}
    assert len(nodes) == 2, nodes
    (drafter_node,) = [i for i, n in nodes.items() if "drafter" in n["resources"]]
    (head_node,) = [i for i, n in nodes.items() if "prefill" in n["resources"]]
    assert drafter_node != head_node
    assert all(n["ip"] == "127.0.0.1" for n in nodes.values())

    # the GCS actor table: where Ray placed each role actor
    placed = ready["actor_nodes"]
    assert placed["specmesh-drafter-0"] == drafter_node, placed
    for iid in ("prefill-0", "verifier-0", "gateway-0"):
        assert placed[f"specmesh-{iid}"] == head_node, (iid, placed)
    assert "specmesh-controller" in placed

    # the OS view: each role's process descends from the raylet of its node's `ray start`
    pids = {iid: info["pid"] for iid, info in ready["infos"].items()}
    assert len(set(pids.values())) == 4 and os.getpid() not in pids.values(), pids
    assert cluster.worker_pid in _ancestors(pids["drafter-0"])
    assert cluster.head_pid not in _ancestors(pids["drafter-0"])
    for iid in ("prefill-0", "verifier-0", "gateway-0"):
        assert cluster.head_pid in _ancestors(pids[iid]), iid

    # what `specmesh launch` printed is the roster the controller pushed to every role
    roster = {r["instance_id"]: r for r in ready["roster"]}
    assert set(roster) == {"prefill-0", "drafter-0", "verifier-0", "gateway-0"}
    assert {i["instance_id"]: i["pid"] for i in multinode["launched"]} == pids
    assert all(r["endpoint"].startswith("tcp://127.0.0.1:") for r in roster.values())
    # every link is CurveZMQ: each role's ROUTER requires it, with its key in the roster
    assert all(r["curve"] and len(r["curve_key"]) == 40 for r in roster.values()), roster
    assert all(h["alive"] and not h["last_error"] for h in ready["health"].values())


def test_stop_roles_script_removes_every_actor(multinode):
    """Last test of the module: deploy/stop_roles.sh stops roles and controller."""
    cluster = multinode["cluster"]
    assert "specmesh-controller" in cluster.probe("named")["named"]
    cluster.run(["bash", str(REPO / "deploy" / "stop_roles.sh")], timeout=90,
                RAY_ADDRESS=cluster.address, PYTHON=sys.executable)
    assert cluster.probe("named")["named"] == []
