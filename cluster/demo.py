"""``specmesh demo`` and ``specmesh bench``: real prompts through the gateway over HTTP with the
official ``openai`` client, speculation on (kappa > 0) and off (kappa = 0) on the same cluster;
``bench`` adds Hugging Face ``generate`` (greedy, and with prompt lookup) in the same run."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources

from cluster.config import ClusterConfig


def load_prompts(limit: int | None = None) -> list[dict]:
    """The bundled prompts: [{name, category, messages}]."""
    text = resources.files("cluster").joinpath("prompts/demo_prompts.json").read_text()
    prompts = json.loads(text)
    return prompts[:limit] if limit else prompts


@dataclass
class RunResult:
    """One pass over the prompts by one system."""

    system: str
    seconds: float = 0.0
    num_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    texts: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accept_len(self) -> float:
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


def run_openai(client, model: str, prompts: list[dict], max_tokens: int, system: str,
               show: bool = False) -> RunResult:
    """Send each prompt (one at a time) through the gateway with the openai client."""
    res = RunResult(system)
    for p in prompts:
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model=model, messages=p["messages"],
                                              max_tokens=max_tokens, temperature=0)
        res.seconds += time.perf_counter() - t0
        res.num_tokens += resp.usage.completion_tokens
        stats = (resp.model_extra or {}).get("spec_stats") or {}
        res.num_draft_tokens += stats.get("num_draft_tokens", 0)
        res.num_accepted_tokens += stats.get("num_accepted_tokens", 0)
        res.num_verify_steps += stats.get("num_verify_steps", 0)
        text = resp.choices[0].message.content or ""
        res.texts.append(text)
        if show:
            print(f"\n### {p['name']} ({p['category']})\n{text}\n"
                  f"[{resp.usage.completion_tokens} tokens, drafted "
                  f"{stats.get('num_draft_tokens', 0)}, accepted "
                  f"{stats.get('num_accepted_tokens', 0)}, mean accept length "
                  f"{stats.get('mean_accept_len', 0):.2f}]", flush=True)
    return res


def run_hf(hf_model, tokenizer, prompts: list[dict], max_tokens: int, system: str,
           prompt_lookup: int | None, eos_token_ids) -> RunResult:
    """Hugging Face ``generate`` greedy (optionally with prompt lookup), one prompt at a time."""
    import torch

    from cluster.cli import chat_prompt_ids

    res = RunResult(system)
    for p in prompts:
        ids = torch.tensor([chat_prompt_ids(tokenizer, p["messages"])])
        kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_tokens, eos_token_id=list(eos_token_ids),
                                    pad_token_id=tokenizer.pad_token_id or 0, **kw)
        res.seconds += time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        res.num_tokens += len(new)
        res.texts.append(tokenizer.decode(new, skip_special_tokens=True))
    return res


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="specmesh", timeout=600, max_retries=0)


def _model_name(cfg: ClusterConfig) -> str:
    from engine.loader import model_name

    return model_name(cfg.model)


def demo(cfg: ClusterConfig, num_prompts: int | None = None, max_tokens: int = 96) -> dict:
    """Start the cluster, run the prompts with speculation on and off, print a table."""
    from cluster.launcher import start_cluster

    prompts = load_prompts(num_prompts)
    print(f"[specmesh] starting cluster: model {_model_name(cfg)}, dtype {cfg.dtype}, "
          f"num_draft_tokens {cfg.num_draft_tokens}, threads {cfg.threads}", flush=True)
    t0 = time.perf_counter()
    handle = start_cluster(cfg)
    print(f"[specmesh] cluster up in {time.perf_counter() - t0:.1f} s; gateway {handle.url}",
          flush=True)
    try:
        client = _client(handle.url)
        model = _model_name(cfg)
        spec = run_openai(client, model, prompts, max_tokens, "speculative", show=True)
        handle.set_num_draft_tokens(0)
        plain = run_openai(client, model, prompts, max_tokens, "kappa=0")
        handle.set_num_draft_tokens(cfg.num_draft_tokens)
    finally:
        handle.stop()
    same = sum(a == b for a, b in zip(spec.texts, plain.texts))
    print("\n| run | tokens | seconds | tokens/s | acceptance rate | mean accept length |")
    print("|---|---|---|---|---|---|")
    for r in (spec, plain):
        print(f"| {r.system} | {r.num_tokens} | {r.seconds:.2f} | {r.tokens_per_s:.2f} | "
              f"{r.acceptance_rate:.2f} | {r.mean_accept_len:.2f} |")
    ratio = spec.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
    print(f"\nspeedup of speculation: {ratio:.2f}x; identical completions with and without "
          f"speculation: {same}/{len(prompts)}")
    return {"speculative": vars(spec), "plain": vars(plain), "speedup": ratio,
            "identical": same}


def bench(cfg: ClusterConfig, repeats: int = 3, max_tokens: int = 64,
          num_prompts: int | None = None, json_path: str | None = None) -> dict:
    """Interleaved repeats of specmesh (kappa>0, kappa=0) and HF generate (greedy, prompt
    lookup) in one run; prints medians and ratios and optionally writes them as JSON."""
    import torch

    from cluster.launcher import start_cluster
    from engine.loader import hf_reference_model, load_tokenizer

    prompts = load_prompts(num_prompts)
    kappa = cfg.num_draft_tokens
    tokenizer = load_tokenizer(cfg.model)
    hf_model = hf_reference_model(cfg.model, cfg.dtype).eval()
    eos = hf_model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    handle = start_cluster(cfg)
    runs: dict[str, list[RunResult]] = {}
    try:
        client = _client(handle.url)
        model = _model_name(cfg)
        run_openai(client, model, prompts[:1], 8, "warmup")

        def specmesh_k(k: int):
            def go() -> RunResult:
                handle.set_num_draft_tokens(k)
                return run_openai(client, model, prompts, max_tokens, f"specmesh k={k}")
            return go

        systems = {
            f"specmesh k={kappa}": specmesh_k(kappa),
            "specmesh k=0": specmesh_k(0),
            "hf generate": lambda: run_hf(hf_model, tokenizer, prompts, max_tokens,
                                          "hf generate", None, eos),
            f"hf prompt lookup k={kappa}": lambda: run_hf(
                hf_model, tokenizer, prompts, max_tokens, f"hf prompt lookup k={kappa}",
                max(kappa, 1), eos),
        }
        names = list(systems)
        torch.set_num_threads(cfg.threads.get("verifier", 2))
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)]  # interleave
            for name in order:
                res = systems[name]()
                runs.setdefault(name, []).append(res)
                print(f"[bench] repeat {r + 1}/{repeats} {name}: {res.num_tokens} tokens, "
                      f"{res.tokens_per_s:.2f} tok/s", flush=True)
    finally:
        handle.set_num_draft_tokens(kappa)
        handle.stop()
    out = _summarize(cfg, runs, prompts, max_tokens, repeats)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def _summarize(cfg, runs, prompts, max_tokens, repeats) -> dict:
    names = list(runs)
    med = {n: statistics.median(r.tokens_per_s for r in runs[n]) for n in names}
    spec, plain = names[0], "specmesh k=0"
    first = {n: runs[n][0] for n in names}
    summary = {
        "model": _model_name(cfg), "dtype": cfg.dtype, "num_draft_tokens": cfg.num_draft_tokens,
        "max_tokens": max_tokens, "num_prompts": len(prompts), "repeats": repeats,
        "threads": cfg.threads,
        "median_tokens_per_s": med,
        "all_tokens_per_s": {n: [r.tokens_per_s for r in runs[n]] for n in names},
        "ratios": {f"{spec} / {n}": med[spec] / med[n] for n in names if n != spec and med[n]},
        "acceptance_rate": first[spec].acceptance_rate,
        "mean_accept_len": first[spec].mean_accept_len,
        "identical_texts_vs_hf_generate": sum(
            a == b for a, b in zip(first[spec].texts, first["hf generate"].texts)),
        "identical_texts_specmesh_k0_vs_hf": sum(
            a == b for a, b in zip(first[plain].texts, first["hf generate"].texts)),
    }
    print("\n| system | median tokens/s | runs |")
    print("|---|---|---|")
    for n in names:
        print(f"| {n} | {med[n]:.2f} | {', '.join(f'{r.tokens_per_s:.2f}' for r in runs[n])} |")
    for k, v in summary["ratios"].items():
        print(f"ratio {k}: {v:.2f}x")
    print(f"acceptance rate {summary['acceptance_rate']:.2f}, mean accept length "
          f"{summary['mean_accept_len']:.2f}; texts identical to HF generate: "
          f"{summary['identical_texts_vs_hf_generate']}/{len(prompts)}")
    return summary
