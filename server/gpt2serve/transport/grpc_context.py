"""The `grpc.aio.ServicerContext` of a call on the built-in gRPC server (grpc_calls.Call): the part
of it our servicers, grpc_health's and grpc_reflection's use."""

from __future__ import annotations

import time
from typing import Protocol

import grpc

from .h2_stream import Stream


class Call(Protocol):
    """What the context reads of its call (grpc_calls.Call)."""

    cancelled: bool
    stream: Stream

    async def send(self, answer) -> None: ...


class CallContext:
    """The part of `grpc.aio.ServicerContext` our servicers use."""

    def __init__(self, call: Call, metadata: tuple[tuple[str, str], ...], deadline: float | None, peer: str):
        self._call, self._metadata, self.deadline, self._peer = call, metadata, deadline, peer
        self.trailing: tuple = ()
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def write(self, answer) -> None:
        """A streaming answer's next message, for a handler that writes rather than yields
        (grpc_health's HealthServicer.Watch)."""
        await self._call.send(answer)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def peer(self) -> str:
        return self._peer

    def cancelled(self) -> bool:
        return self._call.cancelled

    def done(self) -> bool:
        return self._call.stream.closed
