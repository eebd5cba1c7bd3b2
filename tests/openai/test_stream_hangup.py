"""An OpenAI stream whose reader hangs up: its generations stop and free their KV-cache slots at
once, and the server counts them CANCELLED. The front end answers these streams from its own HTTP
protocol (transport.http_direct): a hang-up while events are written ends the stream at its next
write, and one before the first event (the stream still waiting for a slot) is ended by the
cancel of the call's task. One choice is read straight from its generation, several through
interleave's pumps, so both are held.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from support.servers import launch_server, metric_value, openai_client


TEMPLATE_FILE = Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja"


@pytest.fixture(scope="module")
def two_slots(tmp_path_factory):
    """GPT-2 small's shape, so a long generation runs for seconds on any CPU."""
    srv = launch_server(tmp_path_factory.mktemp("two-slots"), "--model", "random:gpt2",
                        "--max-running-sequences", "2", "--chat-template", str(TEMPLATE_FILE))
    yield srv
    srv.stop()


def cancelled(url: str, method: str) -> float:
    return metric_value(url, "gpt2serve_requests_total", {"api": "openai", "method": method, "status": "CANCELLED"})


def wait_for(read, want: float, timeout_s: float = 10.0) -> float:
    deadline = time.monotonic() + timeout_s
    while (got := read()) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.mark.parametrize("route,n", [("completions", 1), ("completions", 2), ("chat", 1), ("chat", 2)])
def test_a_reader_that_hangs_up_stops_its_generations(two_slots, route, n):
    url = two_slots.http_url
    client = openai_client(url)
    method = "Completions" if route == "completions" else "ChatCompletions"
    before = cancelled(url, method)
    if route == "completions":
        stream = client.completions.create(model="random:gpt2", prompt="A very long story", max_tokens=400, n=n,
                                           stream=True, temperature=0, extra_body={"ignore_eos": True})
    else:
        stream = client.chat.completions.create(model="random:gpt2", messages=[{"role": "user", "content": "Go on"}],
                                                max_tokens=400, n=n, stream=True, temperature=0,
                                                extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3 + n):
        next(chunks)
    assert metric_value(url, "gpt2serve_running_sequences") == n
    stream.close()  # hang up mid-stream
    assert wait_for(lambda: metric_value(url, "gpt2serve_running_sequences"), 0) == 0
    assert wait_for(lambda: metric_value(url, "gpt2serve_kv_cache_usage_ratio"), 0) == 0
    assert wait_for(lambda: cancelled(url, method), before + n) == before + n  # each choice's generation
    # Both slots are free: the next request's choices start at once and run to their end.
    answer = client.completions.create(model="random:gpt2", prompt="next", max_tokens=3, n=2)
    assert [c.finish_reason for c in answer.choices] == ["length", "length"]


def test_a_stream_that_hangs_up_before_its_first_chunk_leaves_the_wait_at_once(two_slots):
    """Both slots held: a third stream waits for one. Its reader hangs up before anything was
    written to it, so only the cancel on the hang-up can end it (not a failed write)."""
    url = two_slots.http_url
    client = openai_client(url)
    holder = client.completions.create(model="random:gpt2", prompt="hold both slots", max_tokens=600, n=2,
                                       stream=True, temperature=0, extra_body={"ignore_eos": True})
    held = iter(holder)
    next(held), next(held)
    assert metric_value(url, "gpt2serve_running_sequences") == 2
    before = cancelled(url, "Completions")
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "random:gpt2", "prompt": "wait", "max_tokens": 5, "stream": True}).encode()
    waiting = socket.create_connection((host, int(port)), timeout=30)
    waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert wait_for(lambda: metric_value(url, "gpt2serve_waiting_sequences"), 1) == 1
    waiting.close()
    assert wait_for(lambda: metric_value(url, "gpt2serve_waiting_sequences"), 0, timeout_s=5) == 0
    assert wait_for(lambda: cancelled(url, "Completions"), before + 1, timeout_s=5) == before + 1
    assert metric_value(url, "gpt2serve_running_sequences") == 2  # the holder's choices went on
    holder.close()
