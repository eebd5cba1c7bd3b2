"""Overload and shutdown: a burst far over the queue is refused at once and everything accepted
is answered correctly; SIGTERM drains the requests in flight, refuses new ones, and exits in time."""

from __future__ import annotations

import asyncio
import re
import signal
import time

import httpx
import pytest
from support.servers import launch_server, metric_value, requests_total
from support.reference import assert_matches_reference

from gpt2serve_client import AsyncClient, Gpt2ServeError, NextTokenResult

# Long enough that a forward of a batch clearly outlasts taking in 300 requests on 2 busy cores
# (with 96 tokens our faster engine answered a first batch before the median refusal came back).
PROMPT_TOKENS = 256


DRAIN_PROMPT_TOKENS = 96  # the drain only needs work still queued when new work is refused


def prompt(i: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    return [(i * 7919 + j * 31) % 50000 for j in range(tokens)]


@pytest.fixture(scope="module")
def gpt2_reference():
    from gpt2serve.engine.loading import load_model

    return load_model("random:gpt2", "cpu", "float32", seed=0).model


async def timed(coro):
    started = time.perf_counter()
    try:
        return await coro, time.perf_counter() - started
    except Gpt2ServeError as exc:
        return exc, time.perf_counter() - started


@pytest.mark.slow
def test_300_concurrent_requests_against_a_queue_of_16(tmp_path, gpt2_reference):
    srv = launch_server(tmp_path, "--model", "random:gpt2", "--max-queue", "16", "--max-batch-size", "8")
    try:
        async def main():
            async with AsyncClient(srv.grpc_target, retries=0, timeout=120) as client, \
                    httpx.AsyncClient(base_url=srv.http_url, timeout=120,
                                      limits=httpx.Limits(max_connections=200)) as http:
                grpc_calls = [timed(client.next_token(prompt(i), top_k=3)) for i in range(150)]
                rest_calls = [timed(http.post("/v1/next-token", json={"prompt_token_ids": prompt(i), "top_k": 3}))
                              for i in range(150, 300)]
                return await asyncio.gather(*grpc_calls, *rest_calls)

        outcomes = asyncio.run(main())
    finally:
        assert srv.stop() == 0
    accepted, refused = [], []
    for i, (outcome, seconds) in enumerate(outcomes):
        if isinstance(outcome, httpx.Response):
            if outcome.status_code == 429:
                assert outcome.headers["retry-after"] == "1"
                refused.append((outcome.json()["error"], seconds))
            else:
                assert outcome.status_code == 200, outcome.text
                accepted.append((i, NextTokenResult.from_dict(outcome.json()), seconds))
        elif isinstance(outcome, Gpt2ServeError):
            refused.append(({"code": outcome.code, "message": outcome.message}, seconds))
        else:
            accepted.append((i, outcome, seconds))
    assert len(accepted) + len(refused) == 300
    assert all(e["code"] == "RESOURCE_EXHAUSTED" and "queue full" in e["message"] for e, _ in refused)
    assert 16 <= len(accepted) < 100 and len(refused) > 200
    for i, result, _ in accepted:  # every accepted request answered, and answered right
        assert_matches_reference(gpt2_reference, result, prompt(i), 3)
    # Refusals did not wait for the model: faster than any accepted answer, which needs a forward.
    refused_s = sorted(s for _, s in refused)
    accepted_s = sorted(s for _, _, s in accepted)
    assert refused_s[len(refused_s) // 2] < accepted_s[0], (refused_s[len(refused_s) // 2], accepted_s[0])


@pytest.mark.slow
@pytest.mark.timeout(900)  # its grace is 300 s: that, not pyproject's 300 s, bounds the drain
def test_sigterm_drains_60_in_flight_and_refuses_new_work(tmp_path, gpt2_reference):
    grace_s = 300  # long beside the work (seconds): the outcome does not hang on the machine's speed
    srv = launch_server(tmp_path, "--model", "random:gpt2", "--max-batch-size", "16",
                        "--shutdown-grace-s", str(grace_s))

    async def main():
        async with AsyncClient(srv.grpc_target, retries=0, timeout=120) as client, \
                httpx.AsyncClient(base_url=srv.http_url, timeout=30) as http:
            assert (await http.get("/readyz")).status_code == 200
            calls = [asyncio.create_task(client.next_token(prompt(i, DRAIN_PROMPT_TOKENS), top_k=3)) for i in range(60)]
            def accepted() -> float:  # in flight, or already answered (a lone first one may be done)
                return metric_value(srv.http_url, "gpt2serve_in_flight_requests") + \
                    requests_total(srv.http_url, "grpc", "NextToken", "OK")

            while accepted() < 60:  # all 60 accepted by the server
                await asyncio.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while (await http.get("/readyz")).status_code == 200:
                await asyncio.sleep(0.01)
            # Draining: not ready, new work refused on both transports, accepted work continues.
            ready = await http.get("/readyz")
            late_rest = await http.post("/v1/next-token", json={"prompt": "too late"})
            with pytest.raises(Gpt2ServeError) as late_grpc:
                await client.next_token("too late")
            # With the default retries, a draining server is not retried (it says so with a
            # negative grpc-retry-pushback-ms): one refusal counted, UNAVAILABLE for the caller.
            refused_before = requests_total(srv.http_url, "grpc", "NextToken", "UNAVAILABLE")
            async with AsyncClient(srv.grpc_target, timeout=30) as retrying:
                with pytest.raises(Gpt2ServeError) as late_retried:
                    await retrying.next_token("too late, with retries")
            refused = requests_total(srv.http_url, "grpc", "NextToken", "UNAVAILABLE") - refused_before
            assert (late_retried.value.code, refused) == ("UNAVAILABLE", 1), (late_retried.value, refused)
            health = await client.health()
            pending_when_refused = sum(not c.done() for c in calls)
            results = await asyncio.gather(*calls)
            return signalled, ready, late_rest, late_grpc.value, health, pending_when_refused, results

    signalled, ready, late_rest, late_grpc, health, pending, results = asyncio.run(main())
    exit_code = srv.proc.wait(timeout=grace_s + 10)
    exited_after = time.monotonic() - signalled
    assert pending > 0, "the drain was over before new work was tried; make the work longer"
    assert ready.status_code == 503 and not health.serving
    assert late_rest.status_code == 503 and late_rest.json()["error"]["code"] == "UNAVAILABLE"
    assert late_rest.headers["retry-after"] == "1"
    assert late_grpc.code == "UNAVAILABLE" and "shutting down" in late_grpc.message
    for i, result in enumerate(results):
        assert_matches_reference(gpt2_reference, result, prompt(i, DRAIN_PROMPT_TOKENS), 3)
    assert exit_code == 0 and exited_after < grace_s, exited_after
    assert "shutdown complete" in srv.log()
    assert re.search(r"all ([1-9]\d*) request\(s\) in flight at the signal were answered in full", srv.log())
