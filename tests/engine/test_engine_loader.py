"""load_model on a Hugging Face dir (tiny random model) and argument checks."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import onednn
from specmesh.engine.kv_cache import KVCache
from specmesh.engine.linear import RowInvariantLinear
from specmesh.engine.loader import load_model, model_identity_fields
from specmesh.engine.runner import ModelRunner, SeqChunk
from helpers.backends import backend
from helpers.models import tiny_llama


@pytest.mark.parametrize("tied", [False, True])
def test_load_hf_dir_matches_hf(tmp_path, tied):
    hf, _, _ = tiny_llama(seed=5, dtype=torch.float32, tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path / "tiny")
    loaded = load_model(str(tmp_path / "tiny"), dtype="float64")
    assert loaded.name == "tiny" and loaded.tokenizer is None
    assert loaded.model.dtype == torch.float64
    assert (loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight) == tied
    assert model_identity_fields(loaded, 4) == {
        "name": "tiny", "vocab_size": 128, "dtype": "float64", "num_layers": 2,
        "num_kv_heads": 2, "head_dim": 16, "block_size": 4, "kv_cache_dtype": "float64"}
    prompt = list(range(3, 20))
    runner = ModelRunner(loaded.model, loaded.config, KVCache(loaded.config, 8, 4, torch.float64))
    got = runner.forward([SeqChunk(prompt, 0, [0, 1, 2, 3, 4])])[0]
    with torch.no_grad():
        want = hf.double()(torch.tensor([prompt])).logits[0]
    assert (got - want).abs().max().item() < 1e-9


def test_bad_arguments():
    with pytest.raises(ValueError, match="dtype"):
        load_model(None, dtype="int8")
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/model/dir")


def _linears(model: torch.nn.Module) -> list[RowInvariantLinear]:
    return [m for m in model.modules() if isinstance(m, RowInvariantLinear)]


@pytest.mark.skipif(not onednn.available(), reason="no oneDNN")
def test_a_loaded_cpu_model_is_prepacked_before_its_first_forward(tmp_path):
    """Packing every weight (engine/onednn.py) costs ~0.4 s on SmolLM2: load_model pays it,
    not the first request."""
    hf, _, _ = tiny_llama(seed=5, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "tiny")
    packed = backend(prepacked_linear=True)
    fp32 = load_model(str(tmp_path / "tiny"), dtype="float32", backend=packed).model
    users = [m for m in fp32.modules() if hasattr(m, "backend")]  # norms, attention, linears
    assert len(users) > len(_linears(fp32)) and all(m.backend is packed for m in users)
    assert _linears(fp32) and all(x._packed is not None for x in _linears(fp32))
    off = load_model(str(tmp_path / "tiny"), dtype="float32",
                     backend=backend(prepacked_linear=False)).model
    assert all(x._packed is None for x in _linears(off))  # the backend's choice, passed down
    fp64 = load_model(str(tmp_path / "tiny"), dtype="float64").model  # F.linear there
    assert all(x._packed is None for x in _linears(fp64))
