"""``--lora-modules`` parsing, the adapter set a role announces, and the prefill side's LoRA
checks: unknown adapters refused, prefix-cache keys per adapter (engine/lora_modules.py,
prefill/validation.py, prefill/prefix_cache.py)."""

from __future__ import annotations

import pytest

from specmesh.cluster.config import ClusterConfig
from specmesh.engine.block_manager import BlockManager
from specmesh.engine.config import ModelConfig
from specmesh.engine.lora_modules import WEIGHTS_FILE, adapter_set_identity, parse_lora_modules
from specmesh.prefill.prefix_cache import block_keys
from specmesh.prefill.validation import invalid_reason
from specmesh.protocol.messages import PrefillRequest, SamplingParams


def test_parse_lora_modules_both_forms_and_errors():
    assert parse_lora_modules(["a=/x/a", '{"name": "b", "path": "/x/b"}']) == \
        {"a": "/x/a", "b": "/x/b"}
    for bad, word in (("noequals", "NAME=PATH"), ("=/x", "empty"), ("a=", "empty"),
                      ('{"name": "a"}', "JSON")):
        with pytest.raises(ValueError, match=word):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="NAME=PATH"):
        ClusterConfig(lora_modules=("oops",))


def test_adapter_set_identity_names_and_contents(tmp_path):
    for name, data in (("b", b"one"), ("a", b"two"), ("c", b"one")):
        (tmp_path / name).mkdir()
        (tmp_path / name / WEIGHTS_FILE).write_bytes(data)
    ident = adapter_set_identity({n: str(tmp_path / n) for n in "ba"})
    assert ident.split(",")[0].startswith("a@") and ident.split(",")[1].startswith("b@")
    assert adapter_set_identity({}) == ""
    same_name_other_file = adapter_set_identity({"a": str(tmp_path / "b"),
                                                 "b": str(tmp_path / "b")})
    assert same_name_other_file != ident
    with pytest.raises(FileNotFoundError):
        adapter_set_identity({"x": str(tmp_path / "missing")})


def test_prefix_cache_keys_differ_per_adapter():
    ids = list(range(40))
    base, a, b = block_keys(ids, 16), block_keys(ids, 16, salt="a"), block_keys(ids, 16, "b")
    assert len(base) == len(a) == 2
    assert not set(base) & set(a) and not set(a) & set(b)
    assert block_keys(ids, 16, salt="a") == a


def test_prefill_refuses_an_adapter_it_did_not_load():
    cfg = ModelConfig(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=64,
                      rms_norm_eps=1e-6, rope_theta=10000.0)
    bm = BlockManager(8, 4)
    req = PrefillRequest(request_id="r", transfer_id=1, prompt_token_ids=[1, 2, 3],
                         sampling=SamplingParams(max_tokens=4), block_table=[0],
                         lora_name="caps")
    assert "LoRA adapter 'caps' is not loaded" in invalid_reason(req, cfg, bm, None)
    assert invalid_reason(req, cfg, bm, None, {"caps"}) == ""
