"""What one call needs of the service (InferenceService provides it): the calls depend on this,
not on the service's module, so the package has no import cycle."""

from __future__ import annotations

from typing import Protocol

from gpt2serve_client.types import ModelInfo

from ..protocol import EngineClient
from ..telemetry.spans import Telemetry
from .validation import Validator


class CallContext(Protocol):
    telemetry: Telemetry
    validator: Validator
    max_batch_size: int
    stream_interval: int  # --stream-interval: a streamed generation's tokens, this many a message

    def require_model(self) -> tuple[EngineClient, ModelInfo]:
        """The engine client, or UNAVAILABLE while loading and to calls taken after the drain began."""
        ...
