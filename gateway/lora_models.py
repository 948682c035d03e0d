"""LoRA adapters at the gateway (engine/lora.py serves them on prefill and verifier): a request
selects one with ``model: NAME`` and ``/v1/models`` lists them, as vLLM does with
``--lora-modules`` (each card's ``root`` the adapter's path, ``parent`` the base model), and a
response's ``model`` names the adapter its request ran with. ``lora_modules`` (the app's list)
changes at run time (gateway/lora_admin.py)."""

from __future__ import annotations


def lora_name_of(gw, body) -> str:  # noqa: ANN001 - the app's _Gateway, a request body
    """The adapter ``body.model`` names ("" for the base model or no model)."""
    name = body.model
    return name if name is not None and name in getattr(gw, "lora_modules", {}) else ""


def response_model(gw, run) -> str:  # noqa: ANN001 - the app's _Gateway, a RequestRun
    """The ``model`` field of ``run``'s response: the LoRA adapter the request ran with, else
    the base model (vLLM names the adapter a request selected, streamed or not)."""
    return run.req.lora_name or gw.model_name


def lora_model_cards(gw) -> list[dict]:  # noqa: ANN001 - the app's _Gateway
    """One ``/v1/models`` entry per adapter, sorted by name."""
    return [{"id": name, "object": "model", "created": gw.created, "owned_by": "specmesh",
             "root": path, "parent": gw.model_name, "max_model_len": gw.max_model_len}
            for name, path in sorted(getattr(gw, "lora_modules", {}).items())]


__all__ = ["lora_model_cards", "lora_name_of", "response_model"]
