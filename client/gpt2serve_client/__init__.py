"""Typed Python client for gpt2serve (gRPC: Client, AsyncClient; REST: RestClient).

Needs neither torch nor transformers.
"""

from .errors import Gpt2ServeError
from .grpc_client import AsyncClient, Client
from .rest_client import RestClient
from .types import (
    Architecture,
    GenerateChunk,
    GenerateResult,
    GenerateTimings,
    GeneratedToken,
    HealthStatus,
    ModelInfo,
    NextTokenResult,
    ParameterBreakdown,
    Timings,
    TokenLogprob,
    Usage,
)

__all__ = [
    "Architecture", "AsyncClient", "Client", "GenerateChunk", "GenerateResult", "GenerateTimings",
    "GeneratedToken", "Gpt2ServeError", "HealthStatus", "ModelInfo",
    "NextTokenResult", "ParameterBreakdown", "RestClient", "Timings", "TokenLogprob", "Usage",
]
