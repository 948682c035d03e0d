"""DFlash drafting end to end through the Ray cluster (``--drafter dflash:PATH``: prefill,
verifier, drafter and gateway in their own processes, ZMQ between them) on the tiny model, with
a DFlash draft trained in the test by ``specmesh train-drafter --method dflash`` for a few
seconds on the outputs of the tiny model's layers 1 and 0: the prefill and verifier roles
learn the seed state ("hidden:1,0") from the checkpoint before the drafter starts and ship the
rows with every commit; greedy output token ids equal plain greedy decoding with drafts
accepted, and a seeded request's output is the same with speculation on and off (drafts
accepted there too)."""

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
from specmesh.drafter.dflash_files import read_dflash_config
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
def tiny_dflash(tiny_model_dir, tmp_path_factory):
    """A 1-layer DFlash draft of the tiny model (block 4, context rows of layers 1 and 0)
    trained on its greedy answers to the prompts (a few seconds of training)."""
    tmp = tmp_path_factory.mktemp("tiny-dflash")
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps({"name": f"t{i}", "messages": m}) + "\n"
                            for i, m in enumerate(MESSAGES)))
    args = build_parser().parse_args([
        "train-drafter", "--method", "dflash", "--model", tiny_model_dir, "--prompts",
        str(path), "--heldout-fraction", "0", "--max-new-tokens", "32", "--gen-batch-size",
        "16", "--feature-layers", "1,0", "--num-layers", "1", "--block", "4", "--epochs", "8",
        "--batch-size", "4", "--lr", "3e-3", "--out", str(tmp / "dflash")])
    train_drafter(args)
    return str(tmp / "dflash")


@pytest.fixture(scope="module")
def dflash_cluster(ray_session, tiny_model_dir, tiny_dflash):
    method, kwargs = parse_drafter(f"dflash:{tiny_dflash}", tiny_model_dir)
    assert (method, kwargs) == ("dflash", {"model": tiny_dflash})
    # the verifier waits for tails in flight, so drafts reach it on a loaded machine too, and
    # verifies every draft (goodput off: these tests are about verifying them)
    cfg = ClusterConfig.create(model=tiny_model_dir, dtype="float32", num_speculative_tokens=3,
                               kv_cache_mb=32, port=0, max_model_len=1024,
                               draft_method=method, drafter_method_kwargs=kwargs,
                               tail_wait_fraction=20.0, drafter_silence_s=5.0,
                               goodput_drafts=False)
    handle = start_cluster(replace(cfg, namespace="specmesh-test-dflash"))
    yield handle
    handle.stop()


def _chat(url: str, msgs: list[dict], **fields) -> tuple[list[int], dict]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=180, json={
        "messages": msgs, "max_tokens": MAX_TOKENS, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["spec_stats"]


def test_checkpoint_names_its_block_and_seed_state(tiny_dflash):
    cfg = read_dflash_config(tiny_dflash)
    assert cfg.block == 4 and cfg.num_layers == 1 and cfg.seed_state == "hidden:1,0"


def test_served_dflash_greedy_equals_plain_decode_with_drafts_accepted(dflash_cluster,
                                                                       tiny_model_dir):
    lm = load_model(tiny_model_dir, "float32")
    plain = InProcessCluster(lm.model, lm.config, num_speculative_tokens=0,
                             eos_token_ids=lm.config.eos_token_ids)
    accepted = drafted = 0
    for msgs in MESSAGES[:6]:
        (want,) = plain.generate(chat_token_ids(lm.tokenizer, [{"messages": msgs}]),
                                 SamplingParams(max_tokens=MAX_TOKENS))
        got, stats = _chat(dflash_cluster.url, msgs, temperature=0)
        assert got == list(want.token_ids)
        drafted += stats["num_draft_tokens"]
        accepted += stats["num_accepted_tokens"]
    assert drafted > 0 and accepted > 0, (drafted, accepted)


def test_served_dflash_seeded_output_is_the_same_with_speculation_on_and_off(dflash_cluster):
    accepted = 0
    for i, msgs in enumerate(MESSAGES[:4]):
        fields = {"temperature": 0.3, "seed": 11 + i}
        off, stats = _chat(dflash_cluster.url, msgs, num_speculative_tokens=0, **fields)
        assert stats["num_draft_tokens"] == 0
        on, stats = _chat(dflash_cluster.url, msgs, num_speculative_tokens=3, **fields)
        assert on == off, msgs
        accepted += stats["num_accepted_tokens"]
    assert accepted > 0
