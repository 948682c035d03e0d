"""Ray driver for tests/multinode/test_m_to_n.py, run in its own process (the pytest process
may already be a driver of the embedded Ray of the other tests, and a driver joins one cluster
only).

    python _mn_driver.py MODEL_DIR PROMPTS_JSON MAX_TOKENS TEMP_DIR LONG_MAX_TOKENS [NODES_JSON]

A ``ray.cluster_utils.Cluster`` of 3 nodes on 127.0.0.1, or, with NODES_JSON (``{"address",
"worker_ips"}``), the nodes _mn_setup.py started on the namespace hosts (_netns_ray.py; this
driver then runs on the head host): the head offers ``gateway``, the two
others ``prefill``, ``verifier`` and ``drafter`` plus a node resource of their own (``mn-0``,
``mn-1``) that role ``<role>-<i>`` also asks a sliver of, so one of each lands on either node;
2 prefill workers, 2 verifiers, 2 drafters and a gateway, each with the options ``specmesh
serve`` gives it (cluster.actors.role_options). Then:

1. every prompt of PROMPTS_JSON at once (one HTTP client thread each, greedy);
2. ``ray.kill(drafter-1, no_restart=True)``: how long until the controller's roster lacks it
   and both verifiers dropped their connection to it (the pushed roster applied);
3. the first four prompts again, served by the drafter left;
4. the fault scenarios of tests/multinode/_mn_faults.py (``Faults.run_all``), on the same
   cluster (LONG_MAX_TOKENS: the long requests' output tokens).

Prints one JSON object on the last stdout line: nodes, where each actor runs, each request's
text / token ids / usage / spec_stats, every role's stats before and after, the controller's health report
and the timings.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from specmesh.cluster.loopback import use_loopback

#: the nodes on the namespace hosts (None: the loopback cluster this driver starts)
NODES = json.loads(open(sys.argv[6]).read()) if len(sys.argv) > 6 else None
if NODES is None:
    use_loopback()  # before `import ray`: every node of the cluster stays on 127.0.0.1

import httpx  # noqa: E402
import ray  # noqa: E402
# tests/multinode, the driver's own folder
from _mn_faults import MODEL_CONTEXT, Faults  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from specmesh.cluster.actors import ACTORS, CONTROLLER_NAME, ROLE_RESOURCE_UNIT, role_options  # noqa: E402
from specmesh.cluster.config import ClusterConfig  # noqa: E402
from specmesh.cluster.launcher import ClusterHandle, get_controller  # noqa: E402
from specmesh.protocol.enums import Role  # noqa: E402

KILLED = "drafter-1"
LEAVE_BOUND_S = 40.0
#: the prefill workers' KV send cap (MiB/s) and KV frame size (tokens): a 1,155-token prompt
#: (~580 KB of the tiny model's KV) takes ~3 s to send, in 19 frames
KV_SEND_MB_S = 0.2
FRAME_TOKENS = 64


def _complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
    r.raise_for_status()
    got = r.json()
    return {"prompt": prompt, "text": got["choices"][0]["text"],
            "token_ids": got["choices"][0]["token_ids"],
            "completion_tokens": got["usage"]["completion_tokens"],
            "spec_stats": got.get("spec_stats", {})}


def start(cfg: ClusterConfig, timeout_s: float) -> ClusterHandle:
    """Controller, then ``<role>-<i>`` for i in 0, 1 on node ``mn-<i>`` and the gateway;
    returns once every verifier is connected to both prefill workers and both drafters and the
    gateway to both verifiers (as cluster.launcher.start_cluster waits)."""
    handle = ClusterHandle(cfg, get_controller(namespace=cfg.namespace))
    plan = [(role, i) for role in (Role.PREFILL, Role.DRAFTER, Role.VERIFIER) for i in range(2)]
    for role, i in [*plan, (Role.GATEWAY, 0)]:
        iid = f"{role.value}-{i}"
        opts = role_options(role, cfg)
        if role is not Role.GATEWAY:
            opts["resources"] = {**opts["resources"], f"mn-{i}": ROLE_RESOURCE_UNIT}
        handle.actors[iid] = ACTORS[role].options(name=f"specmesh-{iid}", **opts).remote(iid, cfg)
    infos = ray.get([a.info.remote() for a in handle.actors.values()], timeout=timeout_s)
    handle.url = next(i["url"] for i in infos if i["role"] == Role.GATEWAY)
    deadline = time.monotonic() + timeout_s
    while True:
        st = handle.stats()
        if all(len(st[f"verifier-{i}"]["ready_peers"]) >= 4 for i in range(2)) \
                and len(st["gateway-0"]["ready_verifiers"]) == 2:
            return handle
        if time.monotonic() > deadline:
            raise TimeoutError(f"cluster roles did not connect: {st}")
        time.sleep(0.2)


def _actor_nodes() -> dict[str, str]:
    out = {}
    for info in ray._private.state.actors().values():
        if info.get("Name") and info.get("State") == "ALIVE":
            out[info["Name"]] = info["Address"]["NodeID"]
    return out


def main() -> None:
    model, prompts_path, max_tokens, temp_dir, long_max_tokens = sys.argv[1:6]
    max_tokens = int(max_tokens)
    prompts = json.loads(open(prompts_path).read())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # atexit stops the nodes
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    node = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "temp_dir": temp_dir,
            "object_store_memory": 80 * 1024 * 1024}
    roles = {r: 1 for r in ("prefill", "verifier", "drafter")}
    if NODES is None:
        cluster = Cluster(initialize_head=True, head_node_args={
            **node, "resources": {"gateway": 1}, "include_dashboard": False})
    else:
        from _netns_ray import connect_and_wait, node_ids_by_ip  # imports ray: netns only

        cluster = None
    try:
        if cluster is not None:
            workers = [cluster.add_node(**node, resources={**roles, f"mn-{i}": 1}).node_id
                       for i in range(2)]
            cluster.wait_for_nodes()
            cluster.connect(namespace="specmesh")
            address = cluster.address
        else:
            connect_and_wait(NODES["address"], 1 + len(NODES["worker_ips"]), "specmesh")
            workers, address = node_ids_by_ip(NODES["worker_ips"]), NODES["address"]
        timings["nodes_s"] = time.monotonic() - t0
        # the prefill workers' KV send is capped so that a long prompt's transfer lasts a few
        # seconds (a fault scenario kills a prefill worker mid-transfer); short prompts fit
        # one frame, which leaves at once
        cfg = ClusterConfig.create(model=model, dtype="float32", num_speculative_tokens=3,
                                   kv_cache_mb=32, port=0, max_model_len=MODEL_CONTEXT,
                                   prefill_max_kv_send_mb_s=KV_SEND_MB_S,
                                   prefill_frame_tokens=FRAME_TOKENS)
        from specmesh.engine.loader import model_files

        model_files(cfg.model, cfg.dtype)
        handle = start(cfg, timeout_s=150)
        timings["roles_s"] = time.monotonic() - t0 - timings["nodes_s"]
        nodes = [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
                  "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]]
        placed = _actor_nodes()
        roster = ray.get(get_controller(namespace=cfg.namespace).get_roster.remote(), timeout=30)
        before = handle.stats()

        t1 = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: _complete(handle.url, p, max_tokens), prompts))
        timings["requests_s"] = time.monotonic() - t1
        after = handle.stats()
        # the gateway learns the verifiers' loads from heartbeat replies (about once a second;
        # later on a loaded machine): wait for both before the snapshot the test reads
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(
                "num_free_blocks" in load
                for load in after.get("gateway-0", {}).get("verifier_loads", {}).values()):
            time.sleep(0.5)
            after = handle.stats()

        # a role killed for good leaves the roster, and its peers get the roster without it
        controller = ray.get_actor(CONTROLLER_NAME, namespace=cfg.namespace)
        t2 = time.monotonic()
        ray.kill(handle.actors.pop(KILLED), no_restart=True)
        left_at = peers_at = None
        timeline = []  # (s after the kill, the killed role's health as the controller sees it)
        while time.monotonic() - t2 < LEAVE_BOUND_S:
            report = ray.get(controller.health_report.remote(), timeout=30)
            seen = (report["roles"].get(KILLED) or {"removed": report["removed"].get(KILLED)},
                    report["num_checks"], report["last_check_age_s"])
            if not timeline or timeline[-1][1:] != seen[1:] or timeline[-1][1] != seen[0]:
                timeline.append((round(time.monotonic() - t2, 2), *seen))
            roster = ray.get(controller.get_roster.remote(), timeout=30)
            if left_at is None and KILLED not in {r["instance_id"] for r in roster}:
                left_at = time.monotonic() - t2
            if left_at is not None:
                st = {i: ray.get(a.stats.remote(), timeout=30) for i, a in
                      handle.actors.items() if i.startswith("verifier")}
                if all(KILLED not in s["ready_peers"] for s in st.values()):
                    peers_at = time.monotonic() - t2
                    break
            time.sleep(0.1)
        health = ray.get(controller.health_report.remote(), timeout=30)
        roster_after_kill = ray.get(controller.get_roster.remote(), timeout=30)
        with ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda p: _complete(handle.url, p, max_tokens), prompts[:4]))
        final = handle.stats()
        timings["mn_s"] = time.monotonic() - t0

        launch = ["--model", model, "--dtype", "float32", "--num-speculative-tokens", "3",
                  "--kv-cache-mb", "32", "--max-model-len", str(MODEL_CONTEXT),
                  "--threads", "1",
                  "--drafter", "ngram", "--max-kv-send-mb-s", str(KV_SEND_MB_S)]
        faults = Faults(handle, controller, int(long_max_tokens)).run_all(
            address, launch, dict(os.environ), LEAVE_BOUND_S)
        timings["faults_s"] = {k: round(v["wall_s"], 1) for k, v in faults.items()}
        timings["total_s"] = time.monotonic() - t0
        out = {"nodes": nodes, "worker_node_ids": workers, "placed": placed,
               "roster": roster, "gateway_url": handle.url,
               "results": results, "before": before, "after": after,
               "left_roster_s": left_at, "kill_timeline": timeline, "peers_updated_s": peers_at, "health": health,
               "roster_after_kill": [r["instance_id"] for r in roster_after_kill],
               "again": again, "final": final, "faults": faults, "timings": timings}
        handle.stop()
    finally:
        try:
            ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    os.environ.pop("RAY_ADDRESS", None)
    main()
