"""The soak's fault injector (benchmarks/soak.py, issue 38): kills a random drafter, prefill or
verifier process every ``every_s`` seconds, as a crash would (Ray then restarts the role: a new
incarnation that registers again, cluster/actors.py). The gateway is never killed: it is the
clients' only door, and what the soak watches is how the requests through it fare.

The kill itself is a function handed in (the soak's is ``ray.kill(actor, no_restart=False)``,
as tests/integration/test_serve_tiny.py's drafter restart does), so the schedule and the
choice run without Ray in tests.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

#: roles the soak kills (instance ids start with the role name)
KILLABLE = ("drafter", "prefill", "verifier")


@dataclass
class Kill:
    """One kill: which role instance, when (the killer's clock, seconds) and the error the kill
    function raised ("" when it worked)."""

    instance_id: str
    at: float
    error: str = ""


@dataclass
class RoleKiller:
    """Kills one of ``targets`` (instance ids of killable roles) at random every ``every_s``
    seconds, the first after ``first_after_s``, until stopped; ``kill(instance_id)`` does it."""

    targets: list[str]
    kill: Callable[[str], None]
    every_s: float
    first_after_s: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    clock: Callable[[], float] = time.monotonic
    kills: list[Kill] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = [t for t in self.targets if not t.startswith(KILLABLE)]
        if bad or not self.targets or not self.every_s > 0:
            raise ValueError(f"targets must be {'/'.join(KILLABLE)} instances (got "
                             f"{self.targets}) and every_s > 0 (got {self.every_s})")

    def kill_one(self) -> Kill:
        """Kill a random target now and record it."""
        iid = self.rng.choice(self.targets)
        k = Kill(iid, self.clock())
        try:
            self.kill(iid)
        except Exception as err:  # noqa: BLE001 - recorded: the soak reports failed kills
            k.error = f"{type(err).__name__}: {err}"
        self.kills.append(k)
        return k

    def run(self, stop: threading.Event) -> list[Kill]:
        """Kill on schedule until ``stop`` is set; returns the kills."""
        if stop.wait(self.first_after_s):
            return self.kills
        while True:
            self.kill_one()
            if stop.wait(self.every_s):
                return self.kills

    def start(self, stop: threading.Event) -> threading.Thread:
        """:meth:`run` in a daemon thread."""
        t = threading.Thread(target=self.run, args=(stop,), name="soak-killer", daemon=True)
        t.start()
        return t
