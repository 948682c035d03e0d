"""Other processes' runnable threads from /proc (engine/cpu_load.py), on fake /proc files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specmesh.engine.cpu_load import free_cpus, running_elsewhere


def _proc(tmp_path: Path, runnable: list[int], states: str) -> tuple[list[str], str]:
    """Fake ``/proc/loadavg`` files (one per sample, runnable counts as given) and a task dir
    with one thread per state letter (a comm with spaces and parentheses, as the kernel
    allows)."""
    files = []
    for i, r in enumerate(runnable):
        f = tmp_path / f"loadavg{i}"
        f.write_text(f"0.50 0.40 0.30 {r}/321 4242\n")
        files.append(str(f))
    tasks = tmp_path / "task"
    for i, state in enumerate(states):
        (tasks / str(100 + i)).mkdir(parents=True)
        (tasks / str(100 + i) / "stat").write_text(f"{100 + i} (ray::Pref (x)) {state} 1 2 3\n")
    return files, str(tasks)


def test_own_running_threads_are_not_counted(tmp_path):
    files, tasks = _proc(tmp_path, [4], "RSRS")  # 4 runnable, 2 of them ours
    assert running_elsewhere(files[0], tasks, num_samples=1) == 2
    assert free_cpus(2, others=2) == 0 and free_cpus(8, others=2) == 6


def test_the_fewest_of_the_samples_is_kept(tmp_path, monkeypatch):
    """A process that runs for one sample only (a heartbeat) does not count; one that runs
    in every sample does."""
    files, tasks = _proc(tmp_path, [3, 1, 2], "R")
    reads = iter(files)
    import specmesh.engine.cpu_load as cpu_load

    real = cpu_load._running_total
    monkeypatch.setattr(cpu_load, "_running_total", lambda path: real(next(reads)))
    assert running_elsewhere("unused", tasks, num_samples=3, gap_s=0.0) == 0
    reads = iter(files[::2])
    assert running_elsewhere("unused", tasks, num_samples=2, gap_s=0.0) == 1


def test_unreadable_proc_means_unknown(tmp_path):
    assert running_elsewhere(str(tmp_path / "missing"), str(tmp_path)) is None
    bad = tmp_path / "bad"
    bad.write_text("garbage\n")
    assert running_elsewhere(str(bad), str(tmp_path), num_samples=1) is None
    with pytest.raises(ValueError, match="num_samples"):
        running_elsewhere(num_samples=0)


@pytest.mark.skipif(not os.path.exists("/proc/loadavg"), reason="needs Linux /proc")
def test_this_machine_reads():
    """On Linux the real files parse; the count is never negative."""
    others = running_elsewhere()
    assert others is not None and others >= 0
    assert 0 <= free_cpus() <= (os.cpu_count() or 1)
