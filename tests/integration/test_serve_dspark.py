"""DSpark drafting end to end through the Ray cluster (``--drafter dspark:PATH``: prefill,
verifier, drafter and gateway in their own processes, ZMQ between them) on the tiny model, with
a DSpark draft (gated Markov head) trained in the test by ``specmesh train-drafter --method
dspark`` for a few seconds: greedy output token ids equal plain greedy decoding with drafts
accepted, a seeded request's output is the same with speculation on and off (drafts accepted
there too), and the drafter role reports its weights and KV pool bytes."""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest

from specmesh.cluster.cli import build_parser
from specmesh.cluster.config import ClusterConfig
from specmesh.cluster.drafter_option import parse_drafter
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.cluster.launcher import start_cluster
from specmesh.drafter.dspark_files import read_dspark_config
from specmesh.drafter.eagle.data import chat_token_ids
from specmesh.drafter.training.eagle import train_drafter
from specmesh.engine.loader import load_model
from specmesh.protocol.messages import SamplingParams

pytestmark = pytest.mark.ray
MAX_TOKENS = 24
TOPICS = ["rivers", "python", "the moon", "tea", "primes", "bikes", "sorting", "volcanoes",
          "poetry", "search", "clouds", "chess"]
MESSAGES = [[{"role": "user", "content": f"Tell me about {t}."}] for t in TOPICS]


@pytest.fixture(scope="module")
def tiny_dspark(tiny_model_dir, tmp_path_factory):
    """A 1-layer DSpark draft of the tiny model (block 4, gated Markov head of rank 16)
    trained on its greedy answers to the prompts (a few seconds of training)."""
    tmp = tmp_path_factory.mktemp("tiny-dspark")
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"name": f"t{i}", "messages": m}) + "\n"
                            for i, m in enumerate(MESSAGES)))
    args = build_parser().parse_args([
        "train-drafter", "--method", "dspark", "--model", tiny_model_dir, "--prompts",
        str(path), "--heldout-fraction", "0", "--max-new-tokens", "32", "--gen-batch-size",
        "16", "--num-layers", "1", "--block", "4", "--markov", "gated", "--markov-rank", "16",
        "--epochs", "8", "--batch-size", "4", "--lr", "3e-3", "--out", str(tmp / "dspark")])
    train_drafter(args)
    return str(tmp / "dspark")


@pytest.fixture(scope="module")
def dspark_cluster(ray_session, tiny_model_dir, tiny_dspark):
    method, kwargs = parse_drafter(f"dspark:{tiny_dspark}+markov=gated+markov_rank=16",
                                   tiny_model_dir)
    assert (method, kwargs) == ("dspark", {"model": tiny_dspark, "markov": "gated",
                                           "markov_rank": 16})
    # the verifier waits for tails in flight, so drafts reach it on a loaded machine too, and
    # verifies every draft (goodput off: these tests are about verifying them)
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               draft_method=method, drafter_method_kwargs=kwargs,
                               tail_wait_fraction=20.0, drafter_silence_s=5.0,
                               goodput_drafts=False)
    handle = start_cluster(replace(cfg, namespace="specmesh-test-dspark"))
    yield handle
    handle.stop()


def _chat(url: str, msgs: list[dict], **fields) -> tuple[list[int], dict]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=180, json={
        "messages": msgs, "max_tokens": MAX_TOKENS, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["spec_stats"]


def test_checkpoint_names_its_markov_head(tiny_dspark):
    meta = read_dspark_config(tiny_dspark)
    assert (meta["markov"], meta["markov_rank"], meta["block"]) == ("gated", 16, 4)


def test_served_dspark_greedy_equals_plain_decode_with_drafts_accepted(dspark_cluster,
                                                                       tiny_model_dir):
    lm = load_model(tiny_model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    accepted = drafted = 0
    for msgs in MESSAGES[:6]:
        (want,) = plain.generate(chat_token_ids(lm.tokenizer, [{"messages": msgs}]),
                                 SamplingParams(max_tokens=MAX_TOKENS))
        got, stats = _chat(dspark_cluster.url, msgs, temperature=0)
        assert got == list(want.token_ids)
        drafted += stats["num_draft_tokens"]
        accepted += stats["num_accepted_tokens"]
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_served_dspark_seeded_output_is_the_same_with_speculation_on_and_off(dspark_cluster):
    accepted = 0
    for i, msgs in enumerate(MESSAGES[:4]):
        fields = {"temperature": 0.3, "seed": 11 + i}
        off, stats = _chat(dspark_cluster.url, msgs, num_speculative_tokens=0, **fields)
        assert stats["num_draft_tokens"] == 0
        on, stats = _chat(dspark_cluster.url, msgs, num_speculative_tokens=3, **fields)
        assert on == off, msgs
        accepted += stats["num_accepted_tokens"]
    assert accepted > 0


def test_drafter_role_reports_weights_and_kv_pool_bytes(dspark_cluster):
    drafters = [s for iid, s in dspark_cluster.stats().items() if "draft_weights_bytes" in s]
    assert drafters, list(dspark_cluster.stats())
    assert all(s["draft_weights_bytes"] > 0 and s["draft_kv_pool_bytes"] > 0 for s in drafters)
