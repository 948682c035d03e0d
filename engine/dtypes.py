"""Names <-> torch dtypes for model weights, KV caches and wire buffers."""

from __future__ import annotations

import torch

#: wire / config dtype name -> torch dtype (names match protocol.messages.DTYPE_ITEMSIZE).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

#: dtypes a model (weights, activations, KV cache) may run in.
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float64", "float16")


#: ``--kv-cache-dtype`` choices (vLLM's option): ``auto`` keeps K/V in the model dtype; a float32
#: model may keep them in bfloat16 or float16, half the bytes a decode step reads per position
#: (engine/kv_cache.py; docs/operations.md, 'KV cache dtype').
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float16")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``.

    Raises:
        ValueError: a dtype with no wire name (complex, float8, ...).
    """
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no wire name") from None


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (or a torch dtype, returned as is) -> ``torch.bfloat16``.

    Raises:
        ValueError: unknown name.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(TORCH_DTYPES)}") from None


def model_dtype(name: str | torch.dtype) -> torch.dtype:
    """Like :func:`torch_dtype` but only for floating model dtypes (see :data:`MODEL_DTYPES`).

    Raises:
        ValueError: unknown or non-floating dtype.
    """
    dtype = torch_dtype(name) if isinstance(name, str) and name in TORCH_DTYPES else name
    if not isinstance(dtype, torch.dtype) or _NAMES.get(dtype) not in MODEL_DTYPES:
        raise ValueError(f"unsupported model dtype {name!r}; use one of {MODEL_DTYPES}")
    return dtype


def resolve_kv_cache_dtype(name: str | torch.dtype, model: str | torch.dtype) -> torch.dtype:
    """The KV cache dtype that ``--kv-cache-dtype name`` gives a model of dtype ``model``:
    ``"auto"`` (or the model's own dtype) is the model dtype; ``"bfloat16"`` / ``"float16"``
    are a 16-bit cache, which only a float32 model may have (the attention widens its K/V to
    float32 exactly, kernels/paged_attention.py).

    Raises:
        ValueError: an unknown name or model dtype, or a 16-bit cache for a model that is not
            float32 (a bfloat16 model's cache is already bfloat16).
    """
    model = model_dtype(model)
    if isinstance(name, str):
        if name == "auto":
            return model
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {name!r}; use one of {KV_CACHE_DTYPES}")
    kv = model_dtype(name)
    if kv != model and (model != torch.float32 or kv not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"kv_cache_dtype {dtype_name(kv)} needs a float32 model (or the "
                         f"model's own dtype); the model is {dtype_name(model)}")
    return kv
