"""LoRA adapters loaded and unloaded while serving, in vLLM's shapes: `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter` {"lora_name"}, answered with vLLM's
plain-text line, errors in OpenAI's shape. Off unless --allow-runtime-lora-updating (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING); behind --api-key like every route. gRPC's LoadAdapter,
UnloadAdapter and ListAdapters answer the same (transport.grpc_server)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..service import InferenceService

LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
PATHS = (LOAD_PATH, UNLOAD_PATH)


class LoadLoraAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr = Field(description="The name requests choose it by (the OpenAI `model`, or `adapter`)")
    lora_path: StrictStr = Field(description="The directory peft's save_pretrained wrote, on the server")
    load_inplace: bool = Field(False, description="Taken for vLLM's shape; a loaded name must be unloaded first")


class UnloadLoraAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: StrictStr
    lora_int_id: StrictInt | None = Field(None, description="Taken for vLLM's shape; the name decides")


def add_lora_routes(app: FastAPI, service: InferenceService, responses: dict) -> None:
    async def load_lora_adapter(body: LoadLoraAdapterBody) -> PlainTextResponse:
        """Load a LoRA adapter as `lora_name`: requests may name it once this answers."""
        await service.update_adapter(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(body: UnloadLoraAdapterBody) -> PlainTextResponse:
        """Stop serving a LoRA adapter: its requests in flight finish, new ones are 404."""
        await service.update_adapter(body.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    for path, handler in ((LOAD_PATH, load_lora_adapter), (UNLOAD_PATH, unload_lora_adapter)):
        app.add_api_route(path, handler, methods=["POST"], response_class=PlainTextResponse, responses=responses)
