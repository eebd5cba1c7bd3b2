"""Scheduling under a long forward pass: the loop stays responsive, a full queue refuses at once,
and a request whose deadline passed never reaches the model."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import launch_server

from gpt2serve_client import AsyncClient, Gpt2ServeError

LONG_PROMPT = [(i * 7919) % 50000 for i in range(700)]


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("sched"), "--model", "random:gpt2", "--max-queue", "4")
    yield srv
    srv.stop()


def test_busy_server_stays_responsive_refuses_overflow_and_drops_expired(small_queue_server):
    srv = small_queue_server

    async def main():
        async with AsyncClient(srv.grpc_target) as client, httpx.AsyncClient(base_url=srv.http_url) as http:
            big = asyncio.create_task(client.next_token_batch([LONG_PROMPT] * 4, top_k=1, timeout=300))
            await asyncio.sleep(0.5)  # The big batch is now in the model worker.
            assert not big.done()

            # Probes answer quickly while the forward runs in its own thread.
            for _ in range(5):
                started = time.perf_counter()
                assert (await client.health()).serving
                assert (await http.get("/healthz")).status_code == 200
                assert time.perf_counter() - started < 0.2  # two probes, each well under 100 ms
                await asyncio.sleep(0.05)

            doomed = asyncio.create_task(client.next_token("too late", timeout=0.3))
            waiting = [asyncio.create_task(client.next_token(f"waiting {i}", top_k=2, timeout=300)) for i in range(3)]
            await asyncio.sleep(0.1)  # All four are queued: the queue is full.

            started = time.perf_counter()
            with pytest.raises(Gpt2ServeError) as overflow:
                await client.next_token("one too many")
            rest_overflow = await http.post("/v1/next-token", json={"prompt": "one too many"})
            rejected_in = time.perf_counter() - started
            assert overflow.value.code == "RESOURCE_EXHAUSTED" and "queue full" in overflow.value.message
            assert rest_overflow.status_code == 429
            assert rest_overflow.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
            assert rejected_in < 0.5 and not big.done(), "rejection waited for the model"

            with pytest.raises(Gpt2ServeError) as expired:
                await doomed
            assert expired.value.code == "DEADLINE_EXCEEDED"

            big_results = await big
            waiting_results = await asyncio.gather(*waiting)
            return big_results, waiting_results

    big_results, waiting_results = asyncio.run(main())
    assert [r.batch_size for r in big_results] == [4] * 4
    # The expired request was still queued when the big batch ended; it was dropped, not run.
    assert [r.batch_size for r in waiting_results] == [3, 3, 3]


def test_a_call_larger_than_the_queue_is_refused(small_queue_server):
    async def main():
        async with AsyncClient(small_queue_server.grpc_target) as client:
            await client.next_token_batch(["x"] * 5)

    with pytest.raises(Gpt2ServeError) as error:
        asyncio.run(main())
    assert error.value.code == "RESOURCE_EXHAUSTED" and "never fit" in error.value.message
