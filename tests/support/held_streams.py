"""Long generations held open over gRPC, to fill a server's KV-cache slots and its wait queue
for as long as a test needs; closing hangs them all up."""

from __future__ import annotations

import threading

from gpt2serve_client import Client, Gpt2ServeError


class HeldGenerations:
    def __init__(self, grpc_target: str, running: int, waiting: int = 0):
        """`running` streams have their first token (each holds a slot) when this returns;
        `waiting` more are sent and wait for a slot, each in a thread."""
        self.clients: list[Client] = []
        self.streams = []  # kept: a stream that is garbage-collected hangs up
        for i in range(running + waiting):
            client = Client(grpc_target, timeout=None)
            self.clients.append(client)
            stream = client.generate_stream(f"hold {i}", max_tokens=1000, temperature=0, ignore_eos=True)
            self.streams.append(stream)
            if i < running:
                next(stream)
            else:
                threading.Thread(target=_first_or_hang_up, args=(stream,), daemon=True).start()

    def close(self) -> None:
        for client in self.clients:
            client.close()

    def __enter__(self) -> HeldGenerations:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _first_or_hang_up(stream) -> None:
    try:
        next(stream)
    except Gpt2ServeError:
        pass  # cancelled when the test hangs up
