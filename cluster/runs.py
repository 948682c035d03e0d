"""Running prompts through a served cluster with the official ``openai`` client, shared by
``specmesh demo`` and ``specmesh bench``: the bundled prompts and one pass's totals."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from importlib import resources

from protocol.spec_stats import SpecStats

#: Client timeout for one request, seconds (a long prompt on a busy 2-core machine).
CLIENT_TIMEOUT_S = 600


def load_prompts(limit: int | None = None) -> list[dict]:
    """The bundled prompts: [{name, category, messages}]."""
    text = resources.files("cluster").joinpath("prompts/demo_prompts.json").read_text()
    prompts = json.loads(text)
    return prompts[:limit] if limit else prompts


@dataclass
class RunResult:
    """One pass over the prompts by one system: tokens, seconds, texts and spec stats."""

    system: str
    seconds: float = 0.0
    num_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    texts: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"system": self.system, "seconds": self.seconds, "num_tokens": self.num_tokens,
                "tokens_per_s": self.tokens_per_s, "spec_stats": self.spec.as_dict(),
                "texts": self.texts}


def openai_client(url: str):
    """An ``openai.OpenAI`` client for the gateway at ``url`` (no retries)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="specmesh", timeout=CLIENT_TIMEOUT_S,
                  max_retries=0)


def run_openai(client, model: str, prompts: list[dict], max_tokens: int, system: str,
               show: bool = False) -> RunResult:
    """Send each prompt (one at a time) through the gateway; greedy."""
    res = RunResult(system)
    for p in prompts:
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model=model, messages=p["messages"],
                                              max_tokens=max_tokens, temperature=0)
        res.seconds += time.perf_counter() - t0
        res.num_tokens += resp.usage.completion_tokens
        stats = (resp.model_extra or {}).get("spec_stats") or {}
        one = SpecStats(stats.get("num_draft_tokens", 0), stats.get("num_accepted_tokens", 0),
                        stats.get("num_verify_steps", 0))
        res.spec.add(one)
        text = resp.choices[0].message.content or ""
        res.texts.append(text)
        if show:
            print(f"\n### {p['name']} ({p['category']})\n{text}\n"
                  f"[{resp.usage.completion_tokens} tokens, drafted {one.num_draft_tokens}, "
                  f"accepted {one.num_accepted_tokens}, mean accept length "
                  f"{one.mean_accept_len:.2f}]", flush=True)
    return res
