"""Typed Python client for gpt2serve (gRPC: Client, AsyncClient; REST: RestClient).

Needs neither torch nor transformers.
"""

from .errors import Gpt2ServeError
from .grpc_client import AsyncClient, Client
from .rest_client import RestClient
from .generation import GenerateChunk, GenerateResult, GenerateTimings, GeneratedToken, GenerationStep, Usage
from .types import (
    Architecture,
    HealthStatus,
    ModelInfo,
    NextTokenResult,
    ParameterBreakdown,
    PromptTokenLogprob,
    ShapeStep,
    Timings,
    TokenLogprob,
    TokenizeResult,
    perplexity,
)

__all__ = [
    "Architecture", "AsyncClient", "Client", "GenerateChunk", "GenerateResult", "GenerateTimings",
    "GeneratedToken", "GenerationStep", "Gpt2ServeError", "HealthStatus", "ModelInfo",
    "NextTokenResult", "ParameterBreakdown", "PromptTokenLogprob", "RestClient", "ShapeStep", "Timings",
    "TokenLogprob", "TokenizeResult", "Usage", "perplexity",
]
