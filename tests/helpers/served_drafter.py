"""The checks every served draft method's end-to-end test makes, through the Ray cluster's
gateway: a cluster of one method started for a test module, chat requests that return their
token ids and spec stats, greedy output equal to the in-process plain greedy decode with drafts
accepted, and a seeded request equal with speculation on and off (a method's own test adds
what only it has: its stats, its checkpoint, its tree)."""

from __future__ import annotations

from dataclasses import replace

import httpx

from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams


def served_drafter_cluster(model_dir: str | None, drafter: str, namespace: str,
                           **settings):  # noqa: ANN201
    """Start a cluster serving ``model_dir`` (None: the bundled SmolLM2) with ``--drafter
    drafter`` in Ray namespace ``namespace``: float32, kappa 3, a small KV pool, any of
    ClusterConfig.create's ``settings`` over those. Returns its handle (the caller stops
    it)."""
    method, kwargs = parse_drafter(drafter, model_dir)
    base = {"dtype": "float32", "num_speculative_tokens": 3, "kv_cache_mb": 32, "port": 0,
            "max_model_len": 1024}
    if model_dir is None:  # SmolLM2: its own context, room for its KV
        base.update(kv_cache_mb=128, max_model_len=None)
    cfg = ClusterConfig.create(model=model_dir, draft_method=method,
                               drafter_method_kwargs=kwargs,
                               **{k: v for k, v in {**base, **settings}.items() if v is not None})
    return start_cluster(replace(cfg, namespace=namespace))


def chat(url: str, messages: list[dict], max_tokens: int, timeout: float = 180,
         **fields) -> tuple[list[int], dict]:
    """POST /v1/chat/completions with ``return_token_ids``: (output token ids, spec stats)."""
    r = httpx.post(f"{url}/v1/chat/completions", timeout=timeout, json={
        "messages": messages, "max_tokens": max_tokens, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["spec_stats"]


def greedy_equals_plain(url: str, model_dir: str | None, conversations: list[list[dict]],
                        max_tokens: int) -> tuple[int, int]:
    """Assert each conversation's greedy served output equals the in-process plain greedy
    decode of the same model (float32); returns the drafts (made, accepted) over them."""
    lm = load_model(model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    drafted = accepted = 0
    for msgs in conversations:
        (want,) = plain.generate(chat_token_ids(lm.tokenizer, [{"messages": msgs}]),
                                 SamplingParams(max_tokens=max_tokens))
        got, stats = chat(url, msgs, max_tokens, temperature=0)
        assert got == list(want.token_ids), msgs
        drafted += stats["num_draft_tokens"]
        accepted += stats["num_accepted_tokens"]
    return drafted, accepted


def seeded_on_equals_off(url: str, conversations: list[list[dict]], max_tokens: int,
                         temperature: float, first_seed: int, kappa: int = 3) -> int:
    """Assert each conversation's seeded sampled output (seed ``first_seed + i``) is the same
    with speculation on (kappa ``kappa``) and off, and that off drafted nothing; returns the
    drafts accepted with it on."""
    accepted = 0
    for i, msgs in enumerate(conversations):
        fields = {"temperature": temperature, "seed": first_seed + i}
        off, off_stats = chat(url, msgs, max_tokens, num_speculative_tokens=0, **fields)
        assert off_stats["num_draft_tokens"] == 0
        on, stats = chat(url, msgs, max_tokens, num_speculative_tokens=kappa, **fields)
        assert on == off, msgs
        accepted += stats["num_accepted_tokens"]
    return accepted


#: Chat prompts the tiny model's drafts are trained on and served with.
TOPICS = ["rivers", "python", "the moon", "tea", "primes", "bikes", "sorting", "volcanoes",
          "poetry", "search", "clouds", "chess"]
TOPIC_MESSAGES = [[{"role": "user", "content": f"Tell me about {t}."}] for t in TOPICS]


def train_tiny_drafter(method: str, model_dir: str, out_dir,  # noqa: ANN001
                       *method_args: str) -> str:
    """``specmesh train-drafter --method method`` on the tiny model's greedy answers to
    :data:`TOPIC_MESSAGES` (1 layer, block 4, a few seconds), with ``method_args`` added;
    returns the checkpoint directory."""
    import json

    from specmesh.cluster.cli import build_parser
    from specmesh.drafter.training.eagle import train_drafter

    path = out_dir / "prompts.jsonl"
    path.write_text("".join(json.dumps({"name": f"t{i}", "messages": m}) + "\n"
                            for i, m in enumerate(TOPIC_MESSAGES)))
    out = out_dir / method
    train_drafter(build_parser().parse_args([
        "train-drafter", "--method", method, "--model", model_dir, "--prompts", str(path),
        "--heldout-fraction", "0", "--max-new-tokens", "32", "--gen-batch-size", "16",
        "--num-layers", "1", "--block", "4", *method_args, "--epochs", "8", "--batch-size",
        "4", "--lr", "3e-3", "--out", str(out)]))
    return str(out)
