"""REST's tokenize and detokenize, in vLLM's shapes: `POST /tokenize` (also `/v1/tokenize`) gives a
text's token ids, or a conversation's through the chat template, with their count and the
longest prompt the server takes; `POST /detokenize` (also `/v1/detokenize`) gives ids back as
text. The gRPC RPCs of the same names answer the same (transport.grpc_server)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..service import InferenceService
from .openai.chat import ChatMessage
from .openai.common import check_model

TOKENIZE_PATHS = ("/tokenize", "/v1/tokenize")
DETOKENIZE_PATHS = ("/detokenize", "/v1/detokenize")


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = Field(None, description="The served model's name, when given (404 if another)")
    prompt: StrictStr | None = Field(None, description="Text to tokenize", examples=["The capital of France is"])
    messages: list[ChatMessage] | None = Field(None, description="A conversation instead, through the chat template")
    add_generation_prompt: StrictBool = Field(True, description="With messages: the assistant's turn opened")
    add_special_tokens: StrictBool = Field(True, description="Taken for vLLM's shape; GPT-2 adds none")
    return_token_strs: StrictBool = Field(False, description="Also each token's text")


class TokenizeResult(BaseModel):
    count: int
    max_model_len: int = Field(description="The longest prompt this server takes")
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeResult(BaseModel):
    prompt: str


def check_served(service: InferenceService, model: str | None) -> None:
    """`model`, when given, must be a served name: the base or an adapter (as the OpenAI routes ask)."""
    if model is not None:
        check_model(model, service.model_info())


def add_tokenize_routes(app: FastAPI, service: InferenceService, responses: dict) -> None:
    async def tokenize(body: TokenizeBody) -> TokenizeResult:
        """A text's token ids as the model reads them, or a conversation's through the chat template.
        No length limit applies: count a prompt before sending it."""
        check_served(service, body.model)
        messages = None if body.messages is None else [m.plain(i) for i, m in enumerate(body.messages)]
        result = await service.tokenize(body.prompt, messages, body.add_generation_prompt, body.return_token_strs)
        return TokenizeResult(**asdict(result))

    async def detokenize(body: DetokenizeBody) -> DetokenizeResult:
        """Token ids back to their text."""
        check_served(service, body.model)
        return DetokenizeResult(prompt=service.detokenize(body.tokens))

    for paths, handler, result in ((TOKENIZE_PATHS, tokenize, TokenizeResult),
                                   (DETOKENIZE_PATHS, detokenize, DetokenizeResult)):
        for path in paths:
            app.add_api_route(path, handler, methods=["POST"], response_model=result, responses=responses,
                              include_in_schema=not path.startswith("/v1/"))
