"""Fault scenarios of issue 9, run by tests/multinode/_mn_driver.py on its M:N cluster after the
concurrent requests, in this order (each leaves the cluster as the next one needs it):

1. ``roles_join``: a prefill worker and a drafter (``prefill-9``, ``drafter-9``) join the
   running cluster with ``specmesh launch``, enter the roster and get work (of 8 requests sent
   at once, some are prefilled and drafted there).
2. ``drafter_loss_reopen``: the drafter holding a long request (one of drafter-0, drafter-9) is
   killed for good; the verifier loses its connection and re-opens the request on the drafter
   left (DraftSync), where it accepts drafts again (docs/architecture.md, 'Drafting': a request
   whose drafter dies
   is re-opened on another drafter); the health check deregisters the dead one.
3. ``drafter_restart``: the last drafter is killed (``ray.kill``, Ray restarts it) after the
   first SSE chunk of a long request that has accepted drafts (two more in flight); a request
   is re-synced on the restarted incarnation (DraftSync) and accepts drafts again. These
   requests ask for ``RESTART_MAX_TOKENS`` (the cluster's model has ``MODEL_CONTEXT``
   positions): they run as plain decode from the kill until the new incarnation is back, which
   they must outlive on either kind of hosts.
4. ``drafter_gone``: the last drafter is killed for good under a long request: it runs on as
   plain decode and its verifier stops waiting for tails (the waits counted per step fall to
   zero).
5. ``verifier_killed``: with a long request on each verifier, verifier-1 is killed for good; its
   request fails with an error within 10 s, the other one completes, a new request succeeds on
   verifier-0.
6. ``prefill_killed``: with the prefill workers' KV send capped (``max_kv_send_mb_s``), a long
   prompt's transfer is under way when its prefill worker is killed for good: the transfer is
   re-issued on another worker and the request completes; then, the other workers killed idle,
   the last one is killed mid-transfer: the request fails with an error within 60 s and the
   verifiers' KV usage returns to zero.

Every request asks for ``return_token_ids``; the test compares ids with plain greedy decode.
Each function returns a JSON-able dict for the test to check.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import httpx
import ray

#: prompts of the long requests (their outputs are compared with plain greedy decode)
LONG_PROMPTS = {"restart": "Long 0: tell me about rivers.", "reopen": "Long 1: the sea.",
                "gone": "Long 2: mountains and valleys.", "verifier_a": "Long 3: a story.",
                "verifier_b": "Long 4: another story.", "after_verifier": "Short 5: colors."}
#: requests sent at once after roles joined (as many as the prefill workers of both verifiers)
#: prompts whose plain greedy output (the tiny model, 24 tokens) gives the n-gram drafter a
#: match at 2-8 steps each, so whichever requests the joined drafter gets, it drafts (5 of the
#: 8 earlier ones never matched, and the join test failed when those went to drafter-9)
JOIN_PROMPTS = [f"Short 6.{i}: numbers and {t}." for i, t in
                [(1, "dogs"), (2, "owls"), (5, "elks"), (8, "rats"), (15, "seals"), (16, "crabs")]
                ] + [f"Short 6.{i}: count {t} {t} {t} {t}, {t} {t} {t} {t}." for i, t in
                     [(2, "owls"), (6, "yaks")]]
JOIN_MAX_TOKENS = 24
AFTER_VERIFIER_MAX_TOKENS = 16
#: positions of the M:N cluster's model (the session's tiny model with a longer context:
#: conftest.py ``m_to_n``) and the cluster's ``max_model_len``
MODEL_CONTEXT = 8192
#: output tokens of the drafter-restart requests. From the kill until Ray has the drafter back
#: (a new worker process) and the verifier re-syncs them they run as plain decode: on a 2-core
#: machine at load 10-16 the re-sync came 6-13 s after the kill with 1,000-1,850 tokens out, on
#: either kind of hosts, and the requests ended 31-58 s after it. With 1,800 tokens they ended
#: 4-8 s after the kill, before the re-sync across namespaces (whose roles then took 10 s
#: longer to start: cluster/metrics_server.py) and, now and then, on the loopback too.
RESTART_MAX_TOKENS = 6000
#: seconds a drafter-restart request may take to complete (the stream's own read timeout)
RESTART_REQUEST_TIMEOUT_S = 300
PREFILL_MAX_TOKENS = 8
#: a prompt whose KV transfer lasts a few seconds under the prefill workers' send cap
LONG_PROMPT_WORDS = 400
POLL_S = 0.05
#: after this long a killed drafter is neither waited for (``drafter_silence_s``, 1 s) nor
#: owed tails (its connection lost for ``drafter_lost_grace_s``, 2 s), seconds
DRAFTER_SETTLE_S = 3.0


def long_prompt(tag: str) -> str:
    words = " ".join(f"w{i % 97}" for i in range(LONG_PROMPT_WORDS))
    return f"{tag}: {words}"


class Stream:
    """One streaming completion (greedy, ``return_token_ids``) read in a thread: the time of
    its first chunk, the output ids, the final spec_stats, or the error event."""

    def __init__(self, url: str, prompt: str, max_tokens: int, request_id: str,
                 num_speculative_tokens: int | None = None) -> None:
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "stream": True, "return_token_ids": True, "request_id": request_id}
        if num_speculative_tokens is not None:  # this request's kappa (0: speculation off)
            self.body["num_speculative_tokens"] = num_speculative_tokens
        self.url, self.prompt = url, prompt
        self.request_id = f"cmpl-{request_id}"  # the gateway's id for it (the verifier's too)
        self.first = threading.Event()
        self.token_ids: list[int] = []
        self.out: dict = {"prompt": prompt, "request_id": request_id, "error": None,
                          "finish_reason": None, "spec_stats": None}
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Stream:
        self.t0 = time.monotonic()
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body,
                              timeout=300) as r:
                if r.status_code != 200:
                    self.out["error"] = f"HTTP {r.status_code}: {r.read().decode()[:500]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.out["error"] = ev["error"].get("message", str(ev["error"]))
                        continue
                    for ch in ev.get("choices", []):
                        self.token_ids += ch.get("token_ids") or []
                        self.out["finish_reason"] = ch.get("finish_reason") \
                            or self.out["finish_reason"]
                    if ev.get("spec_stats"):
                        self.out["spec_stats"] = ev["spec_stats"]
                    if self.token_ids:
                        self.first.set()
        except Exception as err:  # noqa: BLE001 - reported to the test
            self.out["error"] = f"client: {err!r}"
        finally:
            self.out["end_s"] = time.monotonic()
            self.first.set()

    def result(self, timeout: float) -> dict:
        self.thread.join(timeout)
        return {**self.out, "token_ids": list(self.token_ids),
                "finished": not self.thread.is_alive()}


def complete(url: str, prompt: str, max_tokens: int, request_id: str) -> dict:
    """A non-streaming greedy completion with ``return_token_ids``; an error is returned, not
    raised."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "request_id": request_id}
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    got = r.json()
    out = {"prompt": prompt, "request_id": request_id, "status": r.status_code,
           "wall_s": time.monotonic() - t0}
    if r.status_code == 200:
        out.update(token_ids=got["choices"][0]["token_ids"],
                   spec_stats=got.get("spec_stats", {}))
    else:
        out["error"] = got.get("error", {}).get("message", str(got))
    return out


class Faults:
    """The scenarios on a started cluster (``handle``: cluster.launcher.ClusterHandle)."""

    def __init__(self, handle, controller, long_max_tokens: int, timeout_s: float = 120) -> None:
        self.handle, self.controller = handle, controller
        self.url = handle.url
        self.long_max_tokens = long_max_tokens
        self.timeout_s = timeout_s

    # -- views -----------------------------------------------------------------------------

    def stats(self, iid: str) -> dict:
        return ray.get(self.handle.actors[iid].stats.remote(), timeout=30)

    def verifiers(self) -> list[str]:
        return sorted(i for i in self.handle.actors if i.startswith("verifier"))

    def drafters(self) -> list[str]:
        return sorted(i for i in self.handle.actors if i.startswith("drafter"))

    def view(self, rid: str) -> tuple[str | None, dict | None]:
        """(verifier, the verifier's view of request ``rid``), or (None, None) when no
        verifier holds it."""
        for v in self.verifiers():
            got = self.stats(v)["requests"].get(rid)
            if got is not None:
                return v, got
        return None, None

    def wait_view(self, rid: str, ok, timeout: float) -> tuple[str | None, dict | None]:
        """Poll until ``ok(view)`` holds for ``rid``'s view; (None, last view) when it is gone
        (seen, then no more) or time runs out."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            v, view = self.view(rid)
            if view is None:
                if last is not None:
                    return None, last
                time.sleep(POLL_S)  # not there yet
                continue
            if ok(view):
                return v, view
            last = view
            time.sleep(POLL_S)
        return None, last

    def roster(self) -> list[str]:
        return sorted(r["instance_id"]
                      for r in ray.get(self.controller.get_roster.remote(), timeout=30))

    def kill(self, iid: str, restart: bool) -> float:
        actor = self.handle.actors[iid] if restart else self.handle.actors.pop(iid)
        ray.kill(actor, no_restart=not restart)
        return time.monotonic()

    def when_back(self, iid: str) -> dict:
        """``info()`` of a role Ray is restarting, once it answers: a call made while the
        actor restarts fails at once (ActorUnavailableError) instead of waiting, which happens
        when the requests in flight end first (a loaded machine; a node on another host)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return ray.get(self.handle.actors[iid].info.remote(), timeout=60)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def start_long(self, key: str, accepted: bool = True,
                   max_tokens: int | None = None) -> tuple[Stream, str, dict]:
        """A long streaming request (``max_tokens``, the long requests' by default); returns
        once its first chunk came (and, with ``accepted``, it has accepted drafts): (stream,
        its verifier, its view)."""
        s = Stream(self.url, LONG_PROMPTS[key], max_tokens or self.long_max_tokens,
                   f"fault-{key}").start()
        if not s.first.wait(self.timeout_s) or s.out["error"]:
            raise RuntimeError(f"{key}: no first chunk: {s.result(1)}")
        v, view = self.wait_view(s.request_id, lambda w: not accepted or (
            w["num_accepted_tokens"] > 0 and w["drafter"]), self.timeout_s)
        if view is None or v is None:
            raise RuntimeError(f"{key}: no accepted drafts while in flight: {view}")
        return s, v, view

    def run_all(self, address: str, launch_args: list[str], env: dict,
                leave_bound_s: float) -> dict:
        """Every scenario in order; one that raises is reported (``exception``) and the next
        ones still run."""
        plan = [("roles_join", lambda: self.roles_join(address, launch_args, env)),
                ("drafter_loss_reopen", lambda: self.drafter_loss_reopen(leave_bound_s)),
                ("drafter_restart", self.drafter_restart),
                ("drafter_gone", lambda: self.drafter_gone(DRAFTER_SETTLE_S)),
                ("verifier_killed", self.verifier_killed),
                ("prefill_killed", self.prefill_killed)]
        out = {}
        for name, fn in plan:
            t0 = time.monotonic()
            try:
                out[name] = fn()
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                out[name] = {"exception": traceback.format_exc()}
            out[name]["wall_s"] = time.monotonic() - t0
        return out

    # -- scenarios -------------------------------------------------------------------------

    def drafter_restart(self) -> dict:
        """Two more requests of the same prompt run alongside the first (both verifiers busy);
        all three ask for ``RESTART_MAX_TOKENS``, so they are still in flight when Ray has the
        drafter back. The first one re-synced on the restarted drafter is followed until it
        accepts drafts again; the re-sync (``resync_s``) and each request's end
        (``ends_after_kill_s``) are timed from the kill."""
        s, _, at_kill = self.start_long("restart", max_tokens=RESTART_MAX_TOKENS)
        killed = at_kill["drafter"]
        streams = [s, *(Stream(self.url, LONG_PROMPTS["restart"], RESTART_MAX_TOKENS,
                               f"fault-restart-{i}").start() for i in (1, 2))]
        # the same request with speculation off, alongside (a verify batch row: next to free),
        # is what the three must equal: plain greedy in process is computed for the first
        # LONG_MAX_TOKENS only (RESTART_MAX_TOKENS of it held the session's reference 10 min)
        plain = Stream(self.url, LONG_PROMPTS["restart"], RESTART_MAX_TOKENS,
                       "fault-restart-plain", num_speculative_tokens=0).start()
        for x in [*streams, plain]:
            x.first.wait(self.timeout_s)
        old = ray.get(self.handle.actors[killed].info.remote(), timeout=30)
        kills = {x.request_id: self.view(x.request_id)[1] or {"num_draft_syncs": 0}
                 for x in streams}
        t_kill = self.kill(killed, restart=True)
        followed = at_resync = None
        deadline = time.monotonic() + self.timeout_s
        while followed is None and time.monotonic() < deadline \
                and any(x.thread.is_alive() for x in streams):
            for x in streams:
                w = self.view(x.request_id)[1]
                if w is not None and w["drafter"] == killed \
                        and w["num_draft_syncs"] > kills[x.request_id]["num_draft_syncs"]:
                    followed, at_resync = x, w
                    break
            time.sleep(POLL_S)
        resync_s = time.monotonic() - t_kill
        at_accept = None
        if followed is not None:  # accepted drafts again after the re-sync (None: never)
            accepted_on, at_accept = self.wait_view(
                followed.request_id,
                lambda w: w["num_accepted_tokens"] > at_resync["num_accepted_tokens"],
                self.timeout_s)
            at_accept = at_accept if accepted_on is not None else None
        finals = [x.result(RESTART_REQUEST_TIMEOUT_S) for x in streams]
        plain_final = plain.result(RESTART_REQUEST_TIMEOUT_S)
        new = self.when_back(killed)
        followed = followed or s
        ends_s = sorted(round(f["end_s"] - t_kill, 1) for f in finals if "end_s" in f)
        return {"killed": killed, "at_kill": at_kill, "resynced_at_kill": kills[
                    followed.request_id], "at_resync": at_resync, "at_accept": at_accept,
                "resync_s": resync_s, "final": finals[streams.index(followed)],
                "finals": finals, "old_incarnation": old["incarnation"],
                "new_incarnation": new["incarnation"], "new_endpoint": new["endpoint"],
                "ends_after_kill_s": ends_s, "plain": plain_final,
                "drafter_stats": self.stats(killed)}

    def drafter_loss_reopen(self, leave_bound_s: float) -> dict:
        s, v, at_kill = self.start_long("reopen")
        killed = at_kill["drafter"]
        (other,) = [d for d in self.drafters() if d != killed]
        syncs_before = self.stats(other)["num_syncs"]
        t_kill = self.kill(killed, restart=False)
        _, at_reopen = self.wait_view(  # re-opened when its connection is lost (2 s grace)
            s.request_id, lambda w: w["drafter"] == other
            and w["num_draft_syncs"] > at_kill["num_draft_syncs"], self.timeout_s)
        reopen_s = time.monotonic() - t_kill
        left_at = peers_at = None
        timeline = []  # (s after the kill, the killed role's health as the controller sees it)
        while time.monotonic() - t_kill < leave_bound_s:
            report = ray.get(self.controller.health_report.remote(), timeout=30)
            seen = (report["roles"].get(killed) or {"removed": report["removed"].get(killed)},
                    report["num_checks"], report["last_check_age_s"])
            if not timeline or timeline[-1][1:] != seen:
                timeline.append((round(time.monotonic() - t_kill, 2), *seen))
            if left_at is None and killed not in self.roster():
                left_at = time.monotonic() - t_kill
            if left_at is not None and all(killed not in self.stats(i)["ready_peers"]
                                           for i in self.verifiers()):
                peers_at = time.monotonic() - t_kill
                break
            time.sleep(0.1)
        _, at_accept = self.wait_view(
            s.request_id, lambda w: w["num_accepted_tokens"] > at_reopen["num_accepted_tokens"],
            self.timeout_s) if at_reopen else (None, None)
        final = s.result(self.timeout_s)
        return {"killed": killed, "other": other, "verifier": v, "at_kill": at_kill,
                "at_reopen": at_reopen, "reopen_s": reopen_s, "at_accept": at_accept,
                "final": final,
                "left_roster_s": left_at, "peers_updated_s": peers_at, "kill_timeline": timeline,
                "health": ray.get(self.controller.health_report.remote(), timeout=30),
                "roster_after_kill": self.roster(),
                "other_syncs": self.stats(other)["num_syncs"] - syncs_before}

    def drafter_gone(self, settle_s: float) -> dict:
        """The last drafter killed for good: the verifier's steps and tail waits at the kill,
        ``settle_s`` later (the drafter silence bound has passed) and at the request's end."""
        (killed,) = self.drafters()

        def counters(v: str, rid: str = "") -> dict:
            st = self.stats(v)
            return {"num_steps": st["num_steps"], "num_tail_waits": st["num_tail_waits"],
                    "committed_len": st["requests"].get(rid, {}).get("committed_len")}

        at_start = {v: counters(v) for v in self.verifiers()}
        s, v, at_kill = self.start_long("gone")
        at_start = at_start[v]
        before = counters(v, s.request_id)
        t_kill = self.kill(killed, restart=False)
        time.sleep(max(0.0, t_kill + settle_s - time.monotonic()))
        settled = counters(v, s.request_id)
        final = s.result(self.timeout_s)
        return {"killed": killed, "verifier": v, "at_kill": at_kill, "at_start": at_start,
                "before": before, "settled": settled, "end": counters(v), "final": final}

    def verifier_killed(self) -> dict:
        streams = {}
        for key in ("verifier_a", "verifier_b"):  # the gateway spreads them: fewest in flight
            s, v, _ = self.start_long(key, accepted=False)  # (no drafter is left by now)
            streams[v] = s
        if sorted(streams) != self.verifiers():
            raise RuntimeError(f"both long requests went to {sorted(streams)}")
        killed, kept = "verifier-1", "verifier-0"
        t_kill = self.kill(killed, restart=False)
        failed = streams[killed].result(self.timeout_s)
        failed["error_after_kill_s"] = failed["end_s"] - t_kill
        survived = streams[kept].result(self.timeout_s)
        before = self.stats(kept)["num_finished"]
        again = complete(self.url, LONG_PROMPTS["after_verifier"], AFTER_VERIFIER_MAX_TOKENS,
                         "fault-after-verifier")
        return {"killed": killed, "failed": failed, "survived": survived, "again": again,
                "kept_finished": self.stats(kept)["num_finished"] - before}

    def _kill_mid_transfer(self, key: str) -> dict:
        """A long prompt's request; once its transfer has frames in but is not complete, its
        prefill worker is killed for good. Returns the response and what was seen."""
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(
            complete(self.url, long_prompt(key), PREFILL_MAX_TOKENS, f"fault-{key}")), daemon=True)
        t.start()
        v, at_kill = self.wait_view(f"cmpl-fault-{key}", lambda w: w["status"] == "prefilling"
                                    and (w["transfer_frames"] or 0) > 0, self.timeout_s)
        if at_kill is None or v is None:
            t.join(self.timeout_s)
            raise RuntimeError(f"{key}: never seen mid-transfer: {at_kill} {out}")
        killed = at_kill["prefill_peer"]
        t_kill = self.kill(killed, restart=False)
        t.join(self.timeout_s)
        out["after_kill_s"] = time.monotonic() - t_kill
        return {"killed": killed, "verifier": v, "at_kill": at_kill, "response": out}

    def prefills(self) -> list[str]:
        return sorted(i for i in self.handle.actors if i.startswith("prefill"))

    def prefill_killed(self) -> dict:
        """Mid-transfer kills: with other prefill workers, then (the others killed idle
        first) with none left."""
        served = {p: self.stats(p)["num_requests"] for p in self.prefills()}
        first = self._kill_mid_transfer("prefill_retry")
        first["served"] = {p: self.stats(p)["num_requests"] - n for p, n in served.items()
                           if p in self.handle.actors}
        _, *extra = self.prefills()  # the first one stays
        for p in extra:
            self.kill(p, restart=False)
        deadline = time.monotonic() + self.timeout_s  # every verifier saw them go
        while time.monotonic() < deadline and any(
                set(extra) & set(self.stats(v)["ready_peers"]) for v in self.verifiers()):
            time.sleep(0.1)
        second = self._kill_mid_transfer("prefill_none")
        deadline = time.monotonic() + 30  # the cancelled transfer's blocks go back
        while True:
            kv = {v: {k: st[k] for k in ("kv_cache_usage", "num_free_blocks", "num_kv_blocks",
                                         "requests")}
                  for v, st in ((v, self.stats(v)) for v in self.verifiers())}
            if all(x["kv_cache_usage"] == 0 and not x["requests"] for x in kv.values()) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return {"retry": first, "none": second, "kv": kv, "roster": self.roster()}

    def roles_join(self, address: str, launch_args: list[str], env: dict) -> dict:
        """``specmesh launch prefill`` and ``specmesh launch drafter`` (two processes at once)
        against the running cluster; then a request."""
        t0 = time.monotonic()
        procs = {role: subprocess.Popen(
            [sys.executable, "-m", "specmesh.cluster.cli", "launch", role, "--address", address,
             "--instance-id", f"{role}-9", *launch_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for role in ("prefill", "drafter")}
        launched = {}
        for role, p in procs.items():
            stdout, stderr = p.communicate(timeout=self.timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"specmesh launch {role} failed ({p.returncode}):\n"
                                   f"{stdout[-2000:]}\n{stderr[-4000:]}")
            launched[role] = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        deadline = time.monotonic() + self.timeout_s
        for v in self.verifiers():
            while not {"prefill-9", "drafter-9"} <= set(self.stats(v)["ready_peers"]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"joined roles never reached {v}: {self.stats(v)}")
                time.sleep(0.2)
        joined_s = time.monotonic() - t0
        for role in ("prefill", "drafter"):
            self.handle.actors[f"{role}-9"] = ray.get_actor(f"specmesh-{role}-9",
                                                            namespace=self.handle.cfg.namespace)
        with ThreadPoolExecutor(len(JOIN_PROMPTS)) as pool:  # enough to reach every worker
            got = list(pool.map(lambda ip: complete(self.url, ip[1], JOIN_MAX_TOKENS,
                                                    f"fault-joined-{ip[0]}"),
                                enumerate(JOIN_PROMPTS)))
        return {"launched": launched, "joined_s": joined_s, "responses": got,
                "roster": self.roster(), "prefill_stats": self.stats("prefill-9"),
                "drafter_stats": self.stats("drafter-9")}


def compared_requests(long_max_tokens: int) -> dict[int, list[str]]:
    """max_tokens -> the prompts of the scenarios' requests whose output ids the test compares
    with plain greedy decode (the drafter-restart requests' first ``long_max_tokens``; all of
    them with the same request served with speculation off)."""
    return {long_max_tokens: [LONG_PROMPTS[k] for k in  # "restart": its first tokens
                              ("restart", "reopen", "gone", "verifier_a", "verifier_b")],
            AFTER_VERIFIER_MAX_TOKENS: [LONG_PROMPTS["after_verifier"]],
            JOIN_MAX_TOKENS: JOIN_PROMPTS,
            PREFILL_MAX_TOKENS: [long_prompt("prefill_retry")]}
