"""CPU time every process of an idle specmesh cluster burns (issue 10: idle roles use no CPU).

    python benchmarks/idle_cpu.py [--model PATH] [--seconds 60]

Starts the embedded cluster (``specmesh serve``'s), sends one request so every role is warm,
then samples user+system CPU seconds of each process of the Ray session (roles, Ray daemons and
agents, this driver) over an idle window from /proc (Linux only), and prints them sorted.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from specmesh.cluster.loopback import use_loopback

use_loopback()

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (its threads included), seconds; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def process_name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except FileNotFoundError:
        return "?"
    return cmd[:70]


def session_pids() -> list[int]:
    """This process and every process whose command line mentions ray (the session's)."""
    out = [os.getpid()]
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            name = process_name(int(d.name))
            if "ray" in name or "raylet" in name or "gcs_server" in name:
                out.append(int(d.name))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()

    from specmesh.cluster.config import ClusterConfig
    from specmesh.cluster.launcher import start_cluster
    from specmesh.cluster.runs import openai_client

    handle = start_cluster(ClusterConfig.create(model=args.model, dtype=args.dtype, port=0))
    try:
        client = openai_client(handle.url)
        client.completions.create(model=client.models.list().data[0].id, prompt="Hello",
                                  max_tokens=4, temperature=0)
        time.sleep(2.0)  # let the last messages settle
        pids = session_pids()
        names = {p: process_name(p) for p in pids}
        before = {p: cpu_seconds(p) for p in pids}
        time.sleep(args.seconds)
        used = sorted(((cpu_seconds(p) - before[p], p) for p in pids), reverse=True)
    finally:
        handle.stop()
    total = sum(u for u, _ in used)
    print(f"CPU seconds over {args.seconds:.0f} idle seconds (total {total:.2f}, "
          f"{100 * total / args.seconds:.1f}% of one core):")
    for u, p in used:
        print(f"{u:8.3f}  {p:7d}  {names[p]}")


if __name__ == "__main__":
    main()
