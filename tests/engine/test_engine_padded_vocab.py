"""Issue 9 scenario 10: a model whose embedding is padded past its tokenizer (Qwen2: 151,665
tokens, 151,936 rows) and whose generation_config.json lists an EOS that config.json does not
(Llama-3-Instruct's <|eot_id|>): the gateway's Hello announces the embedding rows (so the
verifier accepts it), token ids are checked against them, and the verifier stops at every EOS
Hugging Face ``generate`` stops at."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from specmesh.gateway.app import create_app
from specmesh.gateway.server import serve_gateway
from specmesh.cluster.hosts.gateway import GatewayHost
from specmesh.cluster.inprocess import InProcessCluster
from specmesh.engine.loader import load_model, model_identity
from helpers.models import hf_greedy, tiny_llama
from specmesh.protocol.handshake import hello_refusal
from specmesh.protocol.messages import PROTOCOL_VERSION, Hello, ModelIdentity, SamplingParams

PAD = 64  # embedding rows past the tokenizer
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def padded_dir(tmp_path_factory, smollm2_tokenizer):
    path = tmp_path_factory.mktemp("padded-vocab")
    hf, _, _ = tiny_llama(seed=3, dtype=torch.float32, vocab_size=len(smollm2_tokenizer) + PAD,
                          hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                          init_std=0.1, eos_token_id=2, bos_token_id=1)
    hf.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    free = hf_greedy(hf, PROMPT, 8)
    eot = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i] and t != 2)
    # the extra EOS only generation_config.json lists: a token greedy decoding reaches
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, eot]}))
    return str(path), eot, free


def test_gateway_hello_announces_the_embedding_rows_and_the_verifier_accepts_it(padded_dir):
    padded_dir, _, _ = padded_dir
    host = SimpleNamespace(cfg=SimpleNamespace(model=padded_dir, dtype="float32", block_size=4,
                                               kv_cache_dtype="auto"))
    ours = GatewayHost.model_identity(host)
    verifier = ModelIdentity(**model_identity(padded_dir, "float32", 4))
    assert verifier.vocab_size == len(host.tokenizer) + PAD
    assert ours.vocab_size == verifier.vocab_size
    hello = Hello(protocol_version=PROTOCOL_VERSION, role="gateway", instance_id="gateway-0",
                  incarnation=1, model=ours)
    assert hello_refusal(hello, "gateway-0", verifier) == ""


def test_eos_ids_come_from_generation_config_too(padded_dir):
    padded_dir, eot, free = padded_dir
    loaded = load_model(padded_dir, dtype="float32")
    assert loaded.config.eos_token_ids == (2, eot)
    c = InProcessCluster(loaded.model, loaded.config, num_speculative_tokens=2,
                         eos_token_ids=loaded.config.eos_token_ids, num_kv_blocks=32,
                         block_size=4)
    (got,) = c.generate([PROMPT], SamplingParams(max_tokens=8))
    assert got.token_ids == free[:free.index(eot) + 1]  # where HF generate stops too
    assert got.finish_reason == "stop"


def test_token_ids_are_checked_against_the_embedding_rows(smollm2_tokenizer):
    class NoBackend:
        async def generate(self, req):  # pragma: no cover - never reached for a 400
            raise AssertionError("sent a refused request")
            yield

        def abort(self, request_id, reason, num_output_tokens=None):
            pass

    rows = len(smollm2_tokenizer) + PAD
    app = create_app(NoBackend(), smollm2_tokenizer, "padded", 256, vocab_size=rows)
    server, _, port = serve_gateway(app)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                     "stop_token_ids": [rows]})
            assert r.status_code == 400 and "stop_token_ids" in r.text
    finally:
        server.stop()
