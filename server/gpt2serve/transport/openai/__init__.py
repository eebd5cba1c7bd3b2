"""The OpenAI-compatible routes, one module per route family over one shared module (as vLLM's
entrypoints/openai keeps serving_completion.py, serving_chat.py and serving_engine.py):

    completions.py   POST /v1/completions (legacy; echo + logprobs scores a prompt)
    chat.py          POST /v1/chat/completions (messages through the chat template)
    common.py        the error object, refused fields, Choices: n generations over the service's streams
    logprobs.py      both logprobs shapes, and token strings for partial UTF-8

`GET /v1/models` is here. Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Callable

from ...errors import ServeError
from ...service import InferenceService
from .chat import ROUTE as CHAT_ROUTE
from .chat import ChatCompletionBody, ChatCompletions
from .common import OpenAIErrorBody
from .completions import ROUTE as COMPLETIONS_ROUTE
from .completions import CompletionBody, Completions

MODELS_ROUTE = "/v1/models"
PATHS = (COMPLETIONS_ROUTE, CHAT_ROUTE, MODELS_ROUTE)

__all__ = ["CHAT_ROUTE", "COMPLETIONS_ROUTE", "MODELS_ROUTE", "PATHS", "ChatCompletionBody", "CompletionBody",
           "OpenAIErrorBody", "OpenAIRoutes"]


class OpenAIRoutes:
    """The OpenAI-compatible routes over the service."""

    def __init__(self, service: InferenceService, error_body: Callable[[ServeError], dict]):
        """`error_body`: an error as OpenAI's error object (transport.http_errors renders it)."""
        self.service = service
        self.completions = Completions(service, error_body)
        self.chat = ChatCompletions(service, error_body)

    async def list_models(self) -> dict:
        """OpenAI's model list: the one model this server serves, its context, and (as a
        gpt2serve extension) whether chat has a template and where it came from."""
        info = self.service.model_info()
        base = {"id": info.model, "object": "model", "created": 0, "owned_by": "gpt2serve", "root": info.model,
                "parent": None, "max_model_len": info.architecture.n_ctx, "chat_completions": info.chat_completions,
                "chat_template_source": info.chat_template_source or None}
        # Each LoRA adapter is a model of its own name whose parent is the base (vLLM's listing).
        return {"object": "list", "data": [base, *({**base, "id": name, "root": name, "parent": info.model}
                                                  for name in info.adapters)]}
