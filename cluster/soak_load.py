"""The soak's client load (benchmarks/soak.py, issue 38): client threads that send a served
gateway a mix of well-formed and malformed requests until told to stop, and record how each
one ended.

The mix (:data:`KINDS`, picked at random per request by weight): greedy completions, streamed
and not (their token ids are checked later against plain decode); seeded sampled ones (the
same prompt and seed must give the same tokens every time, speculation on or off); unseeded
sampled ones; streams the client closes after the first token (an abort); chat completions;
and malformed bodies (bad JSON, a wrong type, a body over the gateway's size bound), which must
be refused with a 4xx that names the problem. Each request is one :class:`Outcome`: a failure
carries the error text the server gave (``cause``, empty when none came: a hang, a dropped
connection, a 5xx without a message) and the time it took to arrive after the request last
heard anything (its start, or its latest streamed chunk).

Plain ``httpx`` in threads: the soak is a client like any other, and needs no event loop.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

#: request kind -> weight in the mix
KINDS: dict[str, int] = {"greedy": 3, "greedy_stream": 3, "seeded": 2, "sampled": 1,
                         "abort": 2, "chat": 1, "bad_json": 1, "wrong_type": 1,
                         "oversized": 1}
#: kinds whose right answer is a 4xx refusal
MALFORMED = frozenset({"bad_json", "wrong_type", "oversized"})
#: a request that has heard nothing for this long is given up as hung (seconds)
HANG_S = 60.0
#: the oversized body: larger than any generation request bound of the gateway (gateway/limits.py
#: allows 512 bytes per token of max_model_len; 2 MiB + is past it for max_model_len <= 4096)
OVERSIZED_BYTES = 4 << 20


@dataclass
class Outcome:
    """How one soak request ended.

    ``ok``: it got what it asked for (a 200 and a complete answer; for a malformed body, a 4xx
    refusal; for an abort, the first token). ``cause``: the error message the server sent
    when not ok ("" when none came). ``stall_s``: seconds from the request's last sign of
    life (start or latest chunk) to its end. ``note``: what the client itself saw (a timeout, a
    dropped connection, a stream that stopped short), never counted as a cause.
    ``token_ids``: the output of a completed generation (None otherwise)."""

    kind: str
    prompt: str
    ok: bool
    status: int = 0
    cause: str = ""
    started: float = 0.0
    ended: float = 0.0
    stall_s: float = 0.0
    seed: int | None = None
    token_ids: list[int] | None = None
    accepted: int = 0
    #: what the client saw when the server gave no cause (a timeout, a dropped connection)
    note: str = ""

    @property
    def failed(self) -> bool:
        """A request that did not get what it asked for."""
        return not self.ok

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "token_ids"}


def _error_message(body: object) -> str:
    """The ``error.message`` of an OpenAI error body ("" when it has none)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or "")
    return ""


@dataclass
class LoadGenerator:
    """Mixed requests against ``url`` from ``clients`` threads (see the module docstring).

    ``prompts``: completion prompts (greedy ones are checked against the reference for the
    same prompt); ``max_tokens``: per request; ``seeds``: the seeds seeded requests use (few, so
    each (prompt, seed) repeats); ``kinds``: the mix (kind -> weight)."""

    url: str
    prompts: list[str]
    max_tokens: int = 24
    api_key: str | None = None
    seeds: tuple[int, ...] = (11, 12)
    kinds: dict[str, int] = field(default_factory=lambda: dict(KINDS))
    hang_s: float = HANG_S
    #: the HTTP transport (None: httpx's own sockets; a MockTransport in tests)
    transport: httpx.BaseTransport | None = None
    outcomes: list[Outcome] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        unknown = set(self.kinds) - set(KINDS)
        if unknown or not self.prompts:
            raise ValueError(f"unknown request kinds {sorted(unknown)} or no prompts")

    def run(self, clients: int, stop: threading.Event, seed: int = 0) -> list[Outcome]:
        """Send requests from ``clients`` threads until ``stop`` is set, then wait for the
        requests in flight; returns every outcome (also kept in ``outcomes``)."""
        threads = [threading.Thread(target=self._client, args=(stop, random.Random(seed + i)),
                                    name=f"soak-client-{i}", daemon=True)
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.outcomes

    def _client(self, stop: threading.Event, rng: random.Random) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = httpx.Timeout(self.hang_s, connect=10.0)
        kinds, weights = zip(*self.kinds.items())
        with httpx.Client(base_url=self.url, timeout=timeout, headers=headers,
                          transport=self.transport) as client:
            while not stop.is_set():
                kind = rng.choices(kinds, weights)[0]
                out = self.one(client, kind, rng)
                with self._lock:
                    self.outcomes.append(out)

    def one(self, client: httpx.Client, kind: str, rng: random.Random) -> Outcome:
        """Send one request of ``kind``; never raises (a transport error is a failure with
        its text as cause, a timeout a failure without one)."""
        prompt = rng.choice(self.prompts)
        out = Outcome(kind, prompt, ok=False, started=self.clock())
        out.ended = out.started
        last = [out.started]
        try:
            if kind in MALFORMED:
                self._malformed(client, kind, out)
            else:
                self._generate(client, kind, rng, out, last)
        except httpx.TimeoutException:
            out.ok, out.note = False, f"heard nothing for {self.hang_s:g} s"  # hung
        except httpx.HTTPError as err:
            out.ok, out.note = False, f"transport: {type(err).__name__}: {err}"
        out.ended = self.clock()
        out.stall_s = out.ended - last[0]
        return out

    def _malformed(self, client: httpx.Client, kind: str, out: Outcome) -> None:
        headers = {"Content-Type": "application/json"}
        if kind == "bad_json":
            content = b'{"prompt": "hi", "max_tokens": 4'
        elif kind == "wrong_type":
            content = json.dumps({"prompt": out.prompt, "max_tokens": "many"}).encode()
        else:
            content = json.dumps({"prompt": "x " * (OVERSIZED_BYTES // 2),
                                  "max_tokens": 1}).encode()
        r = client.post("/v1/completions", content=content, headers=headers)
        out.status = r.status_code
        out.cause = _error_message(_json(r))
        out.ok = 400 <= r.status_code < 500 and bool(out.cause)

    def _body(self, kind: str, rng: random.Random, out: Outcome) -> tuple[str, dict]:
        body: dict = {"max_tokens": self.max_tokens, "return_token_ids": True}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": out.prompt}]
            body["temperature"] = 0
            return "/v1/chat/completions", body
        body["prompt"] = out.prompt
        if kind in ("greedy", "greedy_stream", "abort"):
            body["temperature"] = 0
        elif kind == "seeded":
            out.seed = rng.choice(self.seeds)
            body.update(temperature=0.8, seed=out.seed)
        else:
            body["temperature"] = 1.0
        body["stream"] = kind in ("greedy_stream", "abort") or (
            kind == "seeded" and rng.random() < 0.5)
        if kind == "abort":
            body["ignore_eos"] = True
        return "/v1/completions", body

    def _generate(self, client: httpx.Client, kind: str, rng: random.Random, out: Outcome,
                  last: list[float]) -> None:
        path, body = self._body(kind, rng, out)
        if not body.get("stream"):
            r = client.post(path, json=body)
            out.status = r.status_code
            data = _json(r)
            if r.status_code != 200:
                out.cause = _error_message(data)
                return
            choice = data["choices"][0]
            out.token_ids = list(choice.get("token_ids") or [])
            out.accepted = int(data.get("spec_stats", {}).get("num_accepted_tokens", 0))
            out.ok = choice.get("finish_reason") in ("stop", "length")
            out.note = "" if out.ok else f"finish_reason {choice.get('finish_reason')}"
            return
        body["stream_options"] = {"include_usage": True}
        ids: list[int] = []
        finish = None
        with client.stream("POST", path, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                out.cause = _error_message(_json(r))
                return
            for line in r.iter_lines():
                last[0] = self.clock()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    out.cause = _error_message(ev) or "an error event without a message"
                    return
                if ev.get("spec_stats"):
                    out.accepted = int(ev["spec_stats"].get("num_accepted_tokens", 0))
                for ch in ev.get("choices", []):
                    ids += ch.get("token_ids") or []
                    finish = ch.get("finish_reason") or finish
                if kind == "abort" and ids:
                    out.ok = True  # leaving the block closes the connection mid-stream
                    return
        out.token_ids = ids
        out.ok = finish in ("stop", "length")
        out.note = "" if out.ok else f"stream ended without a finish (finish_reason {finish})"


def _json(r: httpx.Response) -> object:
    try:
        return r.json()
    except ValueError:
        return None
