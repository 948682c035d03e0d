"""Running prompts through a served cluster with the official ``openai`` client, shared by
``specmesh demo`` and ``specmesh bench``: the bundled prompts, one pass's totals, and a pass
by several concurrent clients."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources

from specmesh.protocol.spec_stats import SpecStats

#: Client timeout for one request, seconds (a long prompt on a busy 2-core machine).
CLIENT_TIMEOUT_S = 600


def load_prompts(limit: int | None = None) -> list[dict]:
    """The bundled prompts: [{name, category, messages}]."""
    text = resources.files("specmesh.data").joinpath("demo_prompts.json").read_text()
    prompts = json.loads(text)
    return prompts[:limit] if limit else prompts


@dataclass
class RunResult:
    """One pass over the prompts by one system: completion tokens, seconds (wall time of the
    pass), texts and spec stats. ``token_ids`` holds each completion's ids when the system
    exposes them (in-process, HF, and the gateway with vLLM's ``return_token_ids``; None for a
    system that does not); ``accepted_per_pos[i]`` counts accepted drafts at
    draft position i; ``profile`` is the verifier's step profile over the pass
    (:meth:`protocol.step_profile.StepProfile.as_dict`); ``concurrency`` is the number of
    concurrent clients (or the batch size)."""

    system: str
    seconds: float = 0.0
    num_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] | None = None
    accepted_per_pos: list[int] = field(default_factory=list)
    profile: dict | None = None
    concurrency: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"system": self.system, "seconds": self.seconds, "num_tokens": self.num_tokens,
                "tokens_per_s": self.tokens_per_s, "spec_stats": self.spec.as_dict(),
                "texts": self.texts, "token_ids": self.token_ids,
                "accepted_per_pos": self.accepted_per_pos, "profile": self.profile,
                "concurrency": self.concurrency}


def openai_client(url: str):
    """An ``openai.OpenAI`` client for the gateway at ``url`` (no retries)."""
    from openai import OpenAI  # openai: slow to import, only the drivers' HTTP runs

    return OpenAI(base_url=f"{url}/v1", api_key="specmesh", timeout=CLIENT_TIMEOUT_S,
                  max_retries=0)


#: vLLM's request extension: the response carries the output token ids (choice ``token_ids``)
RETURN_TOKEN_IDS = {"return_token_ids": True}


def _token_ids(resp) -> list[int] | None:
    """A chat completion's output token ids (None when the server did not return them)."""
    ids = (resp.choices[0].model_extra or {}).get("token_ids")
    return None if ids is None else [int(t) for t in ids]


def _spec_stats(resp) -> SpecStats:
    stats = (resp.model_extra or {}).get("spec_stats") or {}
    return SpecStats(stats.get("num_draft_tokens", 0), stats.get("num_accepted_tokens", 0),
                     stats.get("num_verify_steps", 0))


def run_openai_concurrent(client, model: str, prompts: list[dict], max_tokens: int,
                          system: str, concurrency: int) -> RunResult:
    """Send ``prompts`` through the gateway from ``concurrency`` client threads sharing one
    ``openai`` client (each thread takes the next prompt when its previous one finished);
    greedy. ``seconds`` is the wall time from the first request to the last completion;
    ``texts`` are in prompt order.

    Raises:
        openai.OpenAIError: a request failed (the other threads finish first).
    """
    res = RunResult(system, concurrency=concurrency)
    texts: list[str] = [""] * len(prompts)
    ids: list[list[int] | None] = [None] * len(prompts)
    lock = threading.Lock()

    def one(i: int) -> None:
        resp = client.chat.completions.create(model=model, messages=prompts[i]["messages"],
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body=RETURN_TOKEN_IDS)
        with lock:
            res.num_tokens += resp.usage.completion_tokens
            res.spec.add(_spec_stats(resp))
            texts[i] = resp.choices[0].message.content or ""
            ids[i] = _token_ids(resp)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        for f in futures:
            f.result()
    res.seconds = time.perf_counter() - t0
    res.texts = texts
    res.token_ids = None if None in ids else ids
    return res


def run_openai(client, model: str, prompts: list[dict], max_tokens: int, system: str,
               show: bool = False) -> RunResult:
    """Send each prompt (one at a time) through the gateway; greedy."""
    res = RunResult(system)
    ids: list[list[int] | None] = []
    for p in prompts:
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model=model, messages=p["messages"],
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body=RETURN_TOKEN_IDS)
        res.seconds += time.perf_counter() - t0
        res.num_tokens += resp.usage.completion_tokens
        one = _spec_stats(resp)
        res.spec.add(one)
        text = resp.choices[0].message.content or ""
        res.texts.append(text)
        ids.append(_token_ids(resp))
        if show:
            print(f"\n### {p['name']} ({p['category']})\n{text}\n"
                  f"[{resp.usage.completion_tokens} tokens, drafted {one.num_draft_tokens}, "
                  f"accepted {one.num_accepted_tokens}, mean accept length "
                  f"{one.mean_accept_len:.2f}]", flush=True)
    res.token_ids = None if None in ids else ids
    return res


def same_outputs(a: RunResult, b: RunResult) -> list[bool]:
    """Per request: identical output? Token ids when both runs have them, else texts."""
    if a.token_ids is not None and b.token_ids is not None:
        return [x == y for x, y in zip(a.token_ids, b.token_ids)]
    return [x == y for x, y in zip(a.texts, b.texts)]
