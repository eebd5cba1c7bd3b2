"""SIGTERM drains: every call taken before the signal is answered in full, streams in prefill and
in decode alike, over gRPC, REST and the OpenAI API, in one process and with `--workers 2`; the
log says so. A second signal cuts the drain short, and the log names every call it cut.

The grace is long (300 s) beside the work (seconds), so the outcome does not hang on the
machine's speed; each test checks instead that its streams really were in the state it means
(no token yet, or tokens before and after the signal) when the signal came."""

from __future__ import annotations

import re
import signal
import threading
import time

import openai
import pytest
from support.servers import launch_server, metric_value, wait_for

from gpt2serve_client import Client, RestClient

GRACE_S = 300
pytestmark = pytest.mark.timeout(3 * GRACE_S)  # the grace, not pyproject's 300 s, bounds a drain
LONG_PROMPT = [(i * 7919) % 50000 for i in range(900)]  # seconds of prefill on a CPU


class Streams:
    """Streams run in threads; each notes its chunks, and how many came before the signal."""

    def __init__(self):
        self.signalled = threading.Event()
        self.threads: list[threading.Thread] = []
        self.outcomes: dict[str, dict] = {}
        self.first_chunk: dict[str, threading.Event] = {}

    def start(self, name: str, chunks) -> None:
        """`chunks()` yields (finish_reason or None, is_token) per chunk."""
        outcome = self.outcomes[name] = {"tokens": 0, "before_signal": 0, "finish": None, "error": None}
        first = self.first_chunk[name] = threading.Event()

        def run():
            try:
                for finish, is_token in chunks():
                    outcome["tokens"] += is_token
                    outcome["before_signal"] += not self.signalled.is_set()
                    outcome["finish"] = finish or outcome["finish"]
                    first.set()
            except Exception as exc:  # noqa: BLE001 - reported by the assertions
                outcome["error"] = exc
            finally:
                first.set()

        thread = threading.Thread(target=run, name=name)
        thread.start()
        self.threads.append(thread)

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self.threads)


def start_mixed_streams(srv, streams: Streams, max_tokens: int, grpc: Client, rest: RestClient) -> None:
    """Decode-time streams over each API, each seen to yield a token."""
    oa = openai.OpenAI(base_url=f"{srv.http_url}/v1", api_key="unused", timeout=GRACE_S, max_retries=0)
    settings = dict(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    streams.start("grpc", lambda: ((c.finish_reason, c.token is not None)
                                   for c in grpc.generate_stream("Drain over gRPC", **settings)))
    streams.start("rest", lambda: ((c.finish_reason, c.token is not None)
                                   for c in rest.generate_stream("Drain over REST", **settings)))
    streams.start("openai", lambda: ((c.choices[0].finish_reason, bool(c.choices[0].text))
                                     for c in oa.completions.create(model="random:gpt2", prompt="Drain over OpenAI",
                                                                    max_tokens=max_tokens, temperature=0, stream=True,
                                                                    extra_body={"ignore_eos": True})))
    streams.start("chat", lambda: ((c.choices[0].finish_reason, bool(c.choices[0].delta.content))
                                   for c in oa.chat.completions.create(
                                       model="random:gpt2", messages=[{"role": "user", "content": "Drain"}],
                                       max_tokens=max_tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})))
    for name, first in streams.first_chunk.items():
        assert first.wait(120), name
        assert streams.outcomes[name]["error"] is None, streams.outcomes[name]


def drain_lines(log: str) -> tuple[list[int], list[int], list[tuple[int, str]]]:
    """Per front end: calls in flight at the signal, calls answered in the drain, (count, names) cut."""
    at_signal = [int(n) for n in re.findall(r"shutting down: (\d+) request\(s\) in flight", log)]
    answered = [int(n) for n in re.findall(r"all (\d+) request\(s\) in flight at the signal were answered", log)]
    cut = [(int(n), names) for n, names in re.findall(r"(\d+) request\(s\) still in flight are cut: (.*)", log)]
    return at_signal, answered, cut


def draining_server(tmp_path, workers: str):
    """GPT-2 small's shape, chat on, the long grace."""
    return launch_server(tmp_path, "--model", "random:gpt2", "--workers", workers,
                         "--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}",
                         "--shutdown-grace-s", str(GRACE_S))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_answers_every_stream_taken_in_prefill_and_in_decode(tmp_path, workers):
    srv = draining_server(tmp_path, workers)
    streams = Streams()
    with Client(srv.grpc_target, retries=0, timeout=GRACE_S) as grpc, RestClient(srv.http_url, timeout=GRACE_S) as rest:
        decode_tokens, prefill_tokens = 160, 4
        start_mixed_streams(srv, streams, decode_tokens, grpc, rest)
        for i in range(4):  # 900-token prompts: still in their prefill (or queued for it) at the signal
            prompt = [i + 1, *LONG_PROMPT]
            client = grpc if i % 2 else rest
            streams.start(f"prefill-{i}", lambda c=client, p=prompt: (
                (chunk.finish_reason, chunk.token is not None)
                for chunk in c.generate_stream(p, max_tokens=prefill_tokens, temperature=0, ignore_eos=True)))
        wait_for(lambda: metric_value(srv.http_url, "gpt2serve_in_flight_requests") >= 8, 60,
                 "all eight streams taken")
        # The supervisor's own gauge, with --chat-template checked in it (it once imported
        # prometheus_client before the multiprocess directory was set, and read 0).
        assert metric_value(srv.http_url, "gpt2serve_front_ends_up") == int(workers)
        srv.proc.send_signal(signal.SIGTERM)
        streams.signalled.set()
        streams.join(GRACE_S)
    exit_code = srv.proc.wait(timeout=GRACE_S)
    for name, outcome in streams.outcomes.items():
        expected = prefill_tokens if name.startswith("prefill") else decode_tokens
        assert outcome["error"] is None and outcome["finish"] == "length", (name, outcome)
        assert outcome["tokens"] == expected, (name, outcome)
    # The streams were where the test means: the long prompts had no token at the signal, the
    # others had tokens before it and after it.
    assert all(streams.outcomes[f"prefill-{i}"]["before_signal"] == 0 for i in range(4)), streams.outcomes
    assert all(0 < o["before_signal"] < decode_tokens for n, o in streams.outcomes.items()
               if not n.startswith("prefill")), streams.outcomes
    log = srv.log()
    at_signal, answered, cut = drain_lines(log)
    assert exit_code == 0, log[-3000:]
    assert len(at_signal) == int(workers) and sum(at_signal) == 8, log[-3000:]
    assert sorted(answered) == sorted(at_signal) and not cut, log[-3000:]  # front ends log in any order
    assert "shutdown complete" in log


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_signal_cuts_the_drain_and_the_log_names_each_call_cut(tmp_path, workers):
    srv = draining_server(tmp_path, workers)
    streams = Streams()
    with Client(srv.grpc_target, retries=0, timeout=GRACE_S) as grpc, RestClient(srv.http_url, timeout=GRACE_S) as rest:
        start_mixed_streams(srv, streams, 1000, grpc, rest)  # minutes of work on a CPU
        srv.proc.send_signal(signal.SIGTERM)
        streams.signalled.set()
        wait_for(lambda: len(drain_lines(srv.log())[0]) == int(workers), 30, "every front end draining")
        time.sleep(0.5)  # the streams go on during the drain ...
        before = {name: outcome["tokens"] for name, outcome in streams.outcomes.items()}
        wait_for(lambda: all(o["tokens"] > before[n] for n, o in streams.outcomes.items()), 60, "tokens in the drain")
        srv.proc.send_signal(signal.SIGTERM)  # ... until a second signal
        exit_code = srv.proc.wait(timeout=60)
        streams.join(60)
    for name, outcome in streams.outcomes.items():
        assert outcome["finish"] is None and outcome["tokens"] < 1000, (name, outcome)
        assert "shutting down" in str(outcome["error"]), (name, outcome)  # told, not a broken connection
    log = srv.log()
    _, answered, cut = drain_lines(log)
    assert exit_code == 0, log[-3000:]
    # A front end that took none of the four streams (the kernel spreads connections over the
    # shared port) logs "all 0 ... answered"; none was answered in full on either.
    assert not any(answered) and sum(n for n, _ in cut) == 4, log[-3000:]
    names = "; ".join(names for _, names in cut)
    for call in ("grpc Generate", "POST /v1/generate", "POST /v1/completions", "POST /v1/chat/completions"):
        assert re.search(rf"{re.escape(call)} \(taken \d+\.\d s before\)", names), names
    assert "a second signal" in log
