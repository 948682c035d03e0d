"""vLLM's run-time LoRA endpoints on the gateway's app, ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter`` (what they do and answer: gateway/lora_control.py)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, StrictStr

from specmesh.gateway.api_errors import GatewayError
from specmesh.gateway.lora_control import LoraControl, LoraRefusal


class LoadLoraBody(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest`` (other fields, e.g. ``load_inplace``, are ignored)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr | None = None
    lora_path: StrictStr | None = None


class UnloadLoraBody(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest`` (``lora_int_id`` is ignored: names are the keys)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr | None = None


def add_lora_routes(app: FastAPI, control: LoraControl | None, model_name: str) -> None:
    """Add vLLM's two endpoints to ``app``. ``control`` None: the app has no link to the
    roles, and the endpoints answer 501. ``model_name``: the base model's id, which no
    adapter may take (400)."""

    def ctl() -> LoraControl:
        if control is None:
            raise GatewayError(501, "this gateway has no link to the model roles",
                               type="server_error")
        return control

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraBody):
        c = ctl()
        if body.lora_name == model_name:
            raise GatewayError(400, f"{model_name!r} is the base model's name, not one an "
                                    "adapter may take", type="BadRequestError",
                               param="lora_name")
        try:
            text = await c.load(body.lora_name, body.lora_path)
        except LoraRefusal as err:
            raise _error(err) from None
        return Response(content=text, status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraBody):
        try:
            text = await ctl().unload(body.lora_name)
        except LoraRefusal as err:
            raise _error(err) from None
        return Response(content=text, status_code=200)


def _error(err: LoraRefusal) -> GatewayError:
    return GatewayError(err.status_code, err.message, type=err.type, param=err.param)


__all__ = ["LoadLoraBody", "UnloadLoraBody", "add_lora_routes"]
