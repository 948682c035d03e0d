"""``specmesh bench``: the bundled prompts through specmesh (kappa > 0 and kappa = 0, same
cluster) and through Hugging Face ``generate`` (greedy, and with prompt lookup), interleaved
repeats in one run; prints medians and ratios and optionally writes them as JSON."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from cluster.config import ClusterConfig
from cluster.gateway.tokens import chat_prompt_ids
from cluster.runs import RunResult, load_prompts, openai_client, run_openai


def load_hf_model(model: str | None = None, dtype: str = "float32") -> Any:
    """The transformers model (eval) with the weights specmesh serves for ``model``: the
    Hugging Face baseline of the bench (and the reference of the exactness tests)."""
    from transformers import AutoModelForCausalLM

    from engine.dtypes import model_dtype
    from engine.loader import model_files

    path = model_files(model, dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(dtype)).eval()


def run_hf(hf_model, tokenizer, prompts: list[dict], max_tokens: int, system: str,
           prompt_lookup: int | None, eos_token_ids) -> RunResult:
    """Hugging Face ``generate`` greedy (optionally with prompt lookup), one prompt at a time."""
    import torch

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


def bench(cfg: ClusterConfig, repeats: int = 3, max_tokens: int = 64,
          num_prompts: int | None = None, json_path: str | None = None) -> dict:
    """Interleaved repeats of specmesh (kappa>0, kappa=0) and HF generate (greedy, prompt
    lookup) in one run; prints medians and ratios and optionally writes them as JSON."""
    import torch

    from cluster.launcher import start_cluster
    from engine.loader import load_tokenizer, model_name

    prompts = load_prompts(num_prompts)
    kappa = cfg.verifier.num_speculative_tokens
    model = model_name(cfg.model)
    tokenizer = load_tokenizer(cfg.model)
    hf_model = load_hf_model(cfg.model, cfg.dtype)
    eos = hf_model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    handle = start_cluster(cfg)
    runs: dict[str, list[RunResult]] = {}
    try:
        client = openai_client(handle.url)
        run_openai(client, model, prompts[:1], 8, "warmup")

        def specmesh_k(k: int):
            def go() -> RunResult:
                handle.set_num_speculative_tokens(k)
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
        handle.set_num_speculative_tokens(kappa)
        handle.stop()
    out = summarize(cfg, model, runs, len(prompts), max_tokens, repeats)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def summarize(cfg: ClusterConfig, model: str, runs: dict[str, list[RunResult]],
              num_prompts: int, max_tokens: int, repeats: int) -> dict:
    """Medians, ratios of the first system to the others, spec stats and text identity."""
    names = list(runs)
    med = {n: statistics.median(r.tokens_per_s for r in runs[n]) for n in names}
    spec, plain = names[0], "specmesh k=0"
    first = {n: runs[n][0] for n in names}
    summary = {
        "model": model, "dtype": cfg.dtype,
        "num_speculative_tokens": cfg.verifier.num_speculative_tokens,
        "max_tokens": max_tokens, "num_prompts": num_prompts, "repeats": repeats,
        "threads": cfg.threads,
        "median_tokens_per_s": med,
        "all_tokens_per_s": {n: [r.tokens_per_s for r in runs[n]] for n in names},
        "ratios": {f"{spec} / {n}": med[spec] / med[n] for n in names if n != spec and med[n]},
        "acceptance_rate": first[spec].spec.acceptance_rate,
        "mean_accept_len": first[spec].spec.mean_accept_len,
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
          f"{summary['identical_texts_vs_hf_generate']}/{num_prompts}")
    return summary
