"""The prefix cache in a served engine: under --workers 2 (one engine, two front ends), the same
answers as a server with --prefix-cache-mb 0 over gRPC, REST and the official `openai` client;
hit tokens on the request span and in the counters (and under vLLM's names); ModelInfo's sizes;
a front end killed mid-request leaves the engine and its cache serving."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from support.servers import launch_server, metric_value, pids, wait_for

from gpt2serve_client import Client, RestClient

pytestmark = pytest.mark.slow

PREFIX = random.Random(3).choices(range(50257), k=120)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, receiver):
    cached = launch_server(tmp_path_factory.mktemp("cached"), "--model", "random:tiny", "--workers", "2", "--metrics-compat", "vllm",
                           env=receiver.exporter_env())
    plain = launch_server(tmp_path_factory.mktemp("plain"), "--model", "random:tiny", "--prefix-cache-mb", "0")
    yield cached, plain
    plain.stop()
    cached.stop()


def hits(srv) -> tuple[float, float]:
    return (metric_value(srv.http_url, "gpt2serve_prefix_cache_queries_total"),
            metric_value(srv.http_url, "gpt2serve_prefix_cache_hits_total"))


def assert_same_answer(a, b):
    assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    for x, y in zip(a.top, b.top):
        assert abs(x.logprob - y.logprob) <= 1e-4


def test_model_info_reports_the_cache_and_its_absence(servers):
    cached, plain = servers
    with Client(cached.grpc_target) as c, Client(plain.grpc_target) as p:
        on, off = c.model_info(), p.model_info()
    assert on.prefix_cache_tokens > 0 and on.prefix_cache_tokens % 16 == 0 and on.prefix_cache_bytes > 0
    assert off.prefix_cache_tokens == 0 and off.prefix_cache_bytes == 0
    assert RestClient(cached.http_url).model_info().prefix_cache_tokens == on.prefix_cache_tokens


def test_hits_over_both_apis_answer_as_without_the_cache_and_are_counted(servers):
    cached, plain = servers
    queried, hit = hits(cached)
    first = PREFIX + [1, 2, 3]
    with Client(cached.grpc_target) as c, Client(plain.grpc_target) as p:
        for _ in range(2):  # seen, then kept (the doorkeeper: engine.prefix_cache)
            assert_same_answer(c.next_token(first, top_k=5), p.next_token(first, top_k=5))
        wait_for(lambda: hits(cached)[0] >= queried + 2 * len(first), what="the first prompts counted")
        assert hits(cached)[1] == hit  # nothing cached yet
        batch = [PREFIX + [9], PREFIX[:50] + [4, 5], [7] * 20]
        for a, b in zip(c.next_token_batch(batch, top_k=5), p.next_token_batch(batch, top_k=5)):
            assert_same_answer(a, b)
        scored_c = c.next_token(PREFIX + [8, 8], prompt_logprobs=2)
        scored_p = p.next_token(PREFIX + [8, 8], prompt_logprobs=2)
    for x, y in zip(scored_c.prompt_logprobs[1:], scored_p.prompt_logprobs[1:]):
        # A rank counts strictly better tokens: random:tiny's flat logits hold near-ties within
        # float error (1e-6), which the cached and the whole forward may order either way.
        assert abs(x.logprob - y.logprob) <= 1e-4 and abs(x.rank - y.rank) <= 1
    rest = RestClient(cached.http_url).next_token(PREFIX + [6], top_k=5)
    assert_same_answer(rest, RestClient(plain.http_url).next_token(PREFIX + [6], top_k=5))
    # 112 of 120 shared tokens are whole blocks; the 50-token prompt shares 3 blocks; [7] * 20 none.
    want_hits = 112 + 48 + 0 + 112 + 112
    want_queries = 2 * len(first) + sum(map(len, batch)) + len(PREFIX) + 2 + len(PREFIX) + 1
    wait_for(lambda: hits(cached) == (queried + want_queries, hit + want_hits), timeout=10,
             what=f"counters at {(queried + want_queries, hit + want_hits)}, have {hits(cached)}")
    assert hits(plain) == (0.0, 0.0)
    labels = {"model_name": "random:tiny", "engine": "0"}
    assert metric_value(cached.http_url, "vllm:prefix_cache_hits_total", labels) == hits(cached)[1]
    assert metric_value(cached.http_url, "vllm:prefix_cache_queries_total", labels) == hits(cached)[0]


def test_generations_through_openai_hit_the_cache_with_the_same_tokens(servers):
    cached, plain = servers
    text = "The quick brown fox jumps over the lazy dog. " * 12
    answers = []
    for srv in (cached, plain, cached, cached):  # the third sighting hits (the doorkeeper)
        client = openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="none")
        answers.append(client.completions.create(model="random:tiny", prompt=text, max_tokens=6, temperature=0,
                                                 logprobs=2))
    _, hit = hits(cached)
    assert hit > 0
    tokens = [a.choices[0].logprobs.tokens for a in answers]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3]
    for x, y in zip(answers[3].choices[0].logprobs.token_logprobs, answers[1].choices[0].logprobs.token_logprobs):
        assert abs(x - y) <= 1e-4


def test_a_traced_request_says_how_many_prompt_tokens_came_from_the_cache(servers, receiver):
    cached, _ = servers
    with Client(cached.grpc_target) as c:
        c.next_token(PREFIX + [10])
        c.next_token(PREFIX + [11])  # seen twice: PREFIX's blocks are kept
        result = c.next_token(PREFIX + [12])
        streamed = c.generate(PREFIX + [13, 14], max_tokens=2, temperature=0)
    (span,) = [s for s in receiver.wait_for(result.trace_id, {"gpt2serve.v1.Gpt2Serve/NextToken", "batch"})
               if s.name == "gpt2serve.v1.Gpt2Serve/NextToken"]
    assert span.attributes["gpt2serve.prefix_cache.hit_tokens"] == 112
    batch = [s for s in receiver.trace(result.trace_id) if s.name == "batch"][0]
    assert batch.attributes["gpt2serve.prefix_cache.hit_tokens"] >= 112
    spans = receiver.wait_for(streamed.trace_id, {"gpt2serve.v1.Gpt2Serve/Generate", "prefill"})
    request = [s for s in spans if s.name == "gpt2serve.v1.Gpt2Serve/Generate"][0]
    assert request.attributes["gpt2serve.prefix_cache.hit_tokens"] == 112
    prefill = [s for s in spans if s.name == "prefill"][0]
    assert prefill.attributes["gpt2serve.prefix_cache.hit_tokens"] == 112


def test_a_front_end_killed_mid_request_leaves_the_engine_and_its_cache_serving(servers):
    """Long prompts in flight through both front ends when one is killed: the engine drops or
    finishes them, holds no block for them afterwards (blocks live only within a forward), and
    the prefix is cached and hit through the front ends serving after it."""
    cached, plain = servers
    cached.wait_for_line(r"front-end\[\d+\].*front end listening(.|\n)*front-end\[\d+\].*front end listening")
    victim = pids(cached, "front-end")[0]
    long_prefix = random.Random(5).choices(range(50257), k=200)

    def send(n):
        try:
            return httpx.post(f"{cached.http_url}/v1/next-token", json={"prompt_token_ids": long_prefix + [n]},
                              timeout=60).status_code
        except httpx.HTTPError:
            return None  # its front end was killed

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, n) for n in range(8)]
        time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        assert {f.result() for f in futures} <= {200, None}
    cached.wait_for_line(r"front-end-\d exited")
    with Client(cached.grpc_target) as c, Client(plain.grpc_target) as p:
        c.next_token(long_prefix + [97])  # seen at least once already; this one keeps it
        c.next_token(long_prefix + [98])
        _, hit = hits(cached)
        assert_same_answer(c.next_token(long_prefix + [99], top_k=5), p.next_token(long_prefix + [99], top_k=5))
    wait_for(lambda: hits(cached)[1] >= hit + 192, timeout=10, what="the prefix hit after the kill")
