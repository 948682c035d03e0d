"""One OpenMP team per process (engine/openmp.py): init-time torch work runs in a thread that
has exited before the role's loop thread starts, and roles run libgomp's default wait policy
(spin briefly, then sleep) with the thread plan's counts."""

from __future__ import annotations

import threading

import pytest

from specmesh.cluster.actors import role_options
from specmesh.cluster.config import ClusterConfig, default_threads
from specmesh.cluster.hosts.base import RoleHost
from specmesh.engine.openmp import run_in_released_thread
from specmesh.protocol.enums import Role
from specmesh.protocol.messages import ModelIdentity


def test_runs_in_another_thread_that_has_exited_and_returns_the_result():
    caller = threading.current_thread()
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert run_in_released_thread(work) == 42
    assert seen and seen[0] is not caller
    assert not seen[0].is_alive()  # its OpenMP team went with it


def test_errors_are_reraised_in_the_caller():
    def fail() -> None:
        raise KeyError("no such weight")

    with pytest.raises(KeyError, match="no such weight"):
        run_in_released_thread(fail)


class _RecordingHost(RoleHost):
    """A real RoleHost (mailbox, metrics, loop thread) whose worker only records where it was
    built."""

    role = Role.PREFILL

    def model_identity(self) -> ModelIdentity:
        return ModelIdentity(name="t", vocab_size=8, dtype="float32", num_layers=1,
                             num_kv_heads=1, head_dim=4, block_size=16,
                             kv_cache_dtype="float32")

    def build_worker(self):
        self.built_in = threading.current_thread()

        class _Idle:
            def step(self, timeout_s: float) -> bool:
                threading.Event().wait(min(timeout_s, 0.01))
                return False

        return _Idle()


def test_a_role_host_builds_its_worker_outside_the_loop_and_caller_threads():
    host = _RecordingHost("prefill-t", ClusterConfig.create(host="127.0.0.1", port=0))
    try:
        assert host.built_in is not threading.current_thread()
        assert host.built_in is not host._thread
        assert not host.built_in.is_alive()
    finally:
        host.stop()


def test_roles_keep_the_default_wait_policy_and_the_plans_thread_counts():
    cfg = ClusterConfig.create(threads={**default_threads(2), "verifier": 2})
    for role in Role:
        env = role_options(role, cfg)["runtime_env"]["env_vars"]
        assert "OMP_WAIT_POLICY" not in env  # PASSIVE halves the forward's speed
        assert env["OMP_NUM_THREADS"] == str(cfg.threads[role.value])


def test_the_default_plan_gives_prefill_one_thread_and_the_verifier_every_core():
    assert default_threads(4) == {"verifier": 4, "prefill": 1, "drafter": 1, "gateway": 1}
    assert default_threads(4, model_drafter=True)["verifier"] == 3
