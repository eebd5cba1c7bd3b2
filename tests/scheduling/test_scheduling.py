"""Scheduling under a long forward pass: the loop stays responsive, a full queue refuses at once,
and a request whose deadline passed never reaches the model."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.servers import launch_server, metric_value, until

from gpt2serve_client import AsyncClient, Gpt2ServeError

LONG_PROMPT = [(i * 7919) % 50000 for i in range(700)]


def in_forward(srv, prompts: int):
    """The server says so: `prompts` in the forward under way and none queued (each test waits
    for a state, not for a time that a busy machine may not keep)."""
    return lambda: metric_value(srv.http_url, "gpt2serve_requests_running") == prompts and \
        metric_value(srv.http_url, "gpt2serve_queue_depth") == 0


def queued(srv, prompts: int):
    return lambda: metric_value(srv.http_url, "gpt2serve_queue_depth") == prompts


@pytest.fixture(scope="module")
def small_queue_server(tmp_path_factory):
    # The length-grouping cost is pinned (near what warm-up measures for GPT-2 small on a CPU): a
    # cost measured on a busy machine can come out anywhere and change which prompts share a batch.
    # No prefix cache: these tests hold the engine with the same long prompt again and again,
    # which the cache would answer in a fraction of the time.
    srv = launch_server(tmp_path_factory.mktemp("sched"), "--model", "random:gpt2", "--max-queue", "4",
                        "--fixed-cost-tokens", "40", "--prefix-cache-mb", "0")
    yield srv
    srv.stop()


def test_busy_server_stays_responsive_refuses_overflow_and_drops_expired(small_queue_server):
    srv = small_queue_server

    async def main():
        # retries=0: this measures how fast the server refuses, not how long a client keeps trying.
        async with AsyncClient(srv.grpc_target, retries=0) as client, httpx.AsyncClient(base_url=srv.http_url) as http:
            big = asyncio.create_task(client.next_token_batch([LONG_PROMPT] * 4, top_k=1, timeout=300))
            await until(in_forward(srv, 4), what="the big batch in the forward")
            assert not big.done()

            # Probes answer while the forward runs in its own thread (it lasts seconds: they
            # did not wait for it, whatever this machine's load makes each of them cost).
            for _ in range(5):
                assert (await client.health()).serving
                assert (await http.get("/healthz")).status_code == 200
                await asyncio.sleep(0.05)
            assert not big.done(), "the probes waited for the model"

            doomed = asyncio.create_task(client.next_token("too late", timeout=0.3))
            waiting = [asyncio.create_task(client.next_token(f"waiting {i}", top_k=2, timeout=300)) for i in range(3)]
            await until(queued(srv, 4), what="all four queued: the queue is full")

            with pytest.raises(Gpt2ServeError) as overflow:
                await client.next_token("one too many")
            rest_overflow = await http.post("/v1/next-token", json={"prompt": "one too many"})
            assert overflow.value.code == "RESOURCE_EXHAUSTED" and "queue full" in overflow.value.message
            assert rest_overflow.status_code == 429
            assert rest_overflow.json()["error"]["code"] == "RESOURCE_EXHAUSTED"
            assert not big.done(), "rejection waited for the model"

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
    # Counted as what it was: the deadline passed (not a client cancel, not an error).
    metrics = httpx.get(f"{srv.http_url}/metrics").text
    assert 'gpt2serve_requests_total{api="grpc",method="NextToken",status="DEADLINE_EXCEEDED"} 1.0' in metrics


def test_a_call_larger_than_the_queue_is_refused(small_queue_server):
    async def main():
        async with AsyncClient(small_queue_server.grpc_target) as client:
            await client.next_token_batch(["x"] * 5)

    with pytest.raises(Gpt2ServeError) as error:
        asyncio.run(main())
    assert error.value.code == "INVALID_ARGUMENT" and "never fit" in error.value.message and "--max-queue" in \
        error.value.message  # no amount of waiting serves it: not a 429


def test_a_rest_client_that_hangs_up_leaves_the_queue_at_once(small_queue_server):
    """A REST caller that disconnects frees its queue slot and never reaches the model."""
    srv = small_queue_server
    host, port = srv.http_url.removeprefix("http://").split(":")

    async def main():
        async with AsyncClient(srv.grpc_target) as client:
            big = asyncio.create_task(client.next_token_batch([LONG_PROMPT] * 4, top_k=1, timeout=300))
            await until(in_forward(srv, 4), what="the big batch in the forward, the queue empty")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = b'{"prompt": "hanging up"}'
            writer.write(b"POST /v1/next-token HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            waiting = [asyncio.create_task(client.next_token(f"waiting {i}", timeout=300)) for i in range(3)]
            await until(queued(srv, 4), what="the REST caller and 3 queued")
            # REST caller + 3 = the queue of 4 is full, which proves the REST request was queued.
            with pytest.raises(Gpt2ServeError) as full:
                await client.next_token("no room")
            assert full.value.code == "RESOURCE_EXHAUSTED"

            writer.close()
            await until(queued(srv, 3), what="the hung-up caller gone from the queue")
            assert not big.done()
            late = asyncio.create_task(client.next_token("takes the freed slot", timeout=300))
            await big
            return await asyncio.gather(*waiting, late)

    results = asyncio.run(main())
    # The hung-up request never reached the model: the next batch holds the 4 live ones.
    assert [r.batch_size for r in results] == [4, 4, 4, 4]


def test_a_long_prompt_runs_in_its_own_batch(small_queue_server):
    """Length grouping: a 300-token prompt queued with short ones does not pad them to 300."""
    async def main():
        async with AsyncClient(small_queue_server.grpc_target) as client:
            big = asyncio.create_task(client.next_token_batch([LONG_PROMPT] * 4, top_k=1, timeout=300))
            await until(in_forward(small_queue_server, 4), what="the big batch in the forward")
            short = [asyncio.create_task(client.next_token([464, 3139, 286 + i], timeout=300)) for i in range(3)]
            long = asyncio.create_task(client.next_token(LONG_PROMPT[:300], timeout=300))
            await big
            return await asyncio.gather(*short), await long

    short, long = asyncio.run(main())
    assert [r.batch_size for r in short] == [3, 3, 3]
    assert long.batch_size == 1
