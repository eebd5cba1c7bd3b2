"""`--workers 2`: two front-end processes on the shared ports around one engine process, real
clients on both transports, the whole server's metrics and traces, drain and crashes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest
from support.servers import launch_server, metric_value, pids, requests_total
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import format_span_id, format_trace_id
from support.reference import assert_matches_reference
from support.tracing import LAYER_SPANS, PROMPT, assert_layer_trace
from support.servers import mapped_files

from gpt2serve_client import AsyncClient, Client, Gpt2ServeError, NextTokenResult, RestClient

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def workers(tmp_path_factory, receiver):
    env = receiver.server_env()
    srv = launch_server(tmp_path_factory.mktemp("workers"), "--model", "random:tiny", "--workers", "2",
                        "--trace-sample-ratio", "0", env=env)
    srv.wait_for_line(r"front-end\[\d+\].*front end listening(.|\n)*front-end\[\d+\].*front end listening")
    yield srv
    srv.stop()


def test_each_front_end_runs_on_uvloop(workers):
    assert len(re.findall(r"front-end\[\d+\].*event loop: uvloop", workers.log())) == 2
    assert not re.search(r"engine\[\d+\].*event loop", workers.log())  # the engine keeps asyncio's: its IPC door is a thread of its own


def test_two_front_ends_and_one_engine_answer_both_transports_correctly(workers, tiny_model):
    assert len(pids(workers, "front-end")) == 2 and len(pids(workers, "engine")) == 1
    before = {api: requests_total(workers.http_url, api, "NextToken", "OK") for api in ("grpc", "rest")}
    batches_before = metric_value(workers.http_url, "gpt2serve_batch_size_count")
    prompts = [[464, 3139, 286 + i] for i in range(24)]

    async def main():
        # A connection per call, so the kernel spreads them over both front ends.
        async def grpc_call(prompt):
            async with AsyncClient(workers.grpc_target) as client:
                return await client.next_token(prompt, top_k=3)

        def rest_call(prompt):
            with RestClient(workers.http_url) as client:
                return client.next_token(prompt, top_k=3)

        grpc_results = await asyncio.gather(*(grpc_call(p) for p in prompts))
        rest_results = await asyncio.gather(*(asyncio.to_thread(rest_call, p) for p in prompts))
        return grpc_results, rest_results

    grpc_results, rest_results = asyncio.run(main())
    for prompt, result in [*zip(prompts, grpc_results), *zip(prompts, rest_results)]:
        assert_matches_reference(tiny_model.model, result, prompt, 3)
    # Any front end's /metrics is the whole server's: requests counted by both front ends,
    # batches by the engine.
    for api in ("grpc", "rest"):
        assert requests_total(workers.http_url, api, "NextToken", "OK") - before[api] == len(prompts)
    assert metric_value(workers.http_url, "gpt2serve_batch_size_count") > batches_before
    info = {"model": "random:tiny", "dtype": "float32", "device": "cpu", "weights": "random"}
    assert metric_value(workers.http_url, "gpt2serve_model_info", info) == 1
    with Client(workers.grpc_target) as client:
        assert client.model_info().max_batch_size == 64 and client.health().serving


def test_front_end_processes_load_no_torch(workers):
    """A front end is transports, service and tokenizer: it never loads torch (nor transformers'
    model code), while the engine process does. Its resident memory is logged for the notes."""
    with Client(workers.grpc_target) as client:  # both served at least a little
        client.generate([464, 3139], max_tokens=2, temperature=0)
    (engine,) = pids(workers, "engine")
    assert any("libtorch" in f for f in mapped_files(engine))
    for pid in pids(workers, "front-end"):
        torch_files = [f for f in mapped_files(pid) if "libtorch" in f or "/torch/" in f]
        assert not torch_files, f"front end {pid} mapped {torch_files[:3]}"
        with open(f"/proc/{pid}/status") as status:
            rss = next(line for line in status if line.startswith("VmRSS"))
        print(f"front end {pid}: {rss.strip()}")


def test_one_trace_spans_front_end_and_engine(workers, receiver, tiny_model):
    caller_tracer = TracerProvider().get_tracer("test-caller")
    with caller_tracer.start_as_current_span("caller") as caller, Client(workers.grpc_target) as client:
        result = client.next_token(PROMPT, trace_layers=True)
    caller_trace = format_trace_id(caller.get_span_context().trace_id)
    assert result.trace_id == caller_trace
    spans = receiver.wait_for(caller_trace, {"gpt2serve.v1.Gpt2Serve/NextToken", "queue", "batch", "forward"}
                              | LAYER_SPANS)
    # The request and queue spans come from a front end, batch, forward and blocks from the engine.
    assert_layer_trace(spans, "gpt2serve.v1.Gpt2Serve/NextToken", format_span_id(caller.get_span_context().span_id),
                       tiny_model.model, PROMPT, batch_size=1, padded=len(PROMPT))


def test_killing_a_front_end_leaves_the_other_serving(tmp_path, tiny_model):
    srv = launch_server(tmp_path, "--model", "random:tiny", "--workers", "2")
    try:
        srv.wait_for_line(r"front-end\[\d+\].*front end listening(.|\n)*front-end\[\d+\].*front end listening")
        victim, survivor = pids(srv, "front-end")
        os.kill(victim, signal.SIGKILL)
        srv.wait_for_line(r"front-end-\d exited")
        for i in range(12):  # new connections: the kernel only hands them to the survivor now
            with Client(srv.grpc_target, timeout=10) as client:
                assert_matches_reference(tiny_model.model, client.next_token([464, i + 1], top_k=2), [464, i + 1], 2)
            assert httpx.get(f"{srv.http_url}/readyz", timeout=10).status_code == 200
        assert alive(survivor) and srv.proc.poll() is None
    finally:
        assert srv.stop() == 0


def test_killing_the_engine_gives_unavailable_and_a_nonzero_exit(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:gpt2", "--workers", "2")
    children = pids(srv, "front-end") + pids(srv, "engine")
    (engine,) = pids(srv, "engine")

    async def main():
        async with AsyncClient(srv.grpc_target, retries=0, timeout=60) as client:
            in_flight = [asyncio.create_task(client.next_token([(i * 7919) % 50000 for i in range(900)]))
                         for _ in range(4)]
            await asyncio.sleep(0.5)  # in the engine's forward by now
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
            return outcomes, time.monotonic() - killed

    outcomes, took = asyncio.run(main())
    assert all(isinstance(o, Gpt2ServeError) and o.code == "UNAVAILABLE" for o in outcomes), outcomes
    assert took < 60, took  # at once: not at the client's 120 s timeout
    assert srv.proc.wait(timeout=15) != 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children), "a child outlived the server"


def test_sigterm_drains_60_in_flight_across_front_ends(tmp_path):
    from gpt2serve.engine.loading import load_model

    reference = load_model("random:gpt2", "cpu", "float32", seed=0).model
    srv = launch_server(tmp_path, "--model", "random:gpt2", "--workers", "2", "--max-batch-size", "16")
    # Prompts long enough that a batch of 16 takes longer than the 60 calls take to arrive: with
    # 4-token prompts the first answers came back before the last calls were in (57-59 at once).
    prompts = [[464, 3139, 286] * 64 + [i + 1] for i in range(60)]

    async def main():
        clients = [AsyncClient(srv.grpc_target, retries=0, timeout=120) for _ in range(6)]
        try:
            calls = [asyncio.create_task(clients[i % 6].next_token(p, top_k=3)) for i, p in enumerate(prompts)]
            deadline = time.monotonic() + 60
            while metric_value(srv.http_url, "gpt2serve_in_flight_requests") < 60:
                assert time.monotonic() < deadline and not any(c.done() for c in calls), "never 60 in flight at once"
                await asyncio.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*calls)
        finally:
            for client in clients:
                await client.close()

    results = asyncio.run(main())
    assert srv.proc.wait(timeout=60) == 0
    for prompt, result in zip(prompts, results):
        assert_matches_reference(reference, result, prompt, 3)
    assert "shutdown complete" in srv.log()


def test_generation_through_the_engine_process(workers):
    """Streams cross the IPC door token by token; a caller that hangs up frees its slot in the
    engine process; the gauges the engine sets reach every front end's /metrics."""
    with Client(workers.grpc_target) as grpc, RestClient(workers.http_url) as rest:
        settings = dict(max_tokens=12, temperature=0.8, seed=9, ignore_eos=True)
        whole = grpc.generate("Across the door", **settings)
        assert whole.usage.completion_tokens == 12 and whole.finish_reason == "length"
        streamed = list(rest.generate_stream("Across the door", **settings))
        assert [c.token.token_id for c in streamed if c.token] == [t.token_id for t in whole.tokens]
        with pytest.raises(Gpt2ServeError) as err:
            grpc.generate("x", max_tokens=10_000)
        assert err.value.code == "INVALID_ARGUMENT"
        cancelled = requests_total(workers.http_url, "grpc", "Generate", "CANCELLED")
        stream = grpc.generate_stream("hang up", max_tokens=250, temperature=0, ignore_eos=True)
        next(stream)
        stream.close()
        deadline = time.monotonic() + 5
        while metric_value(workers.http_url, "gpt2serve_running_sequences") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric_value(workers.http_url, "gpt2serve_running_sequences") == 0
        while requests_total(workers.http_url, "grpc", "Generate", "CANCELLED") == cancelled and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert requests_total(workers.http_url, "grpc", "Generate", "CANCELLED") == cancelled + 1
        assert grpc.generate("after", max_tokens=3).usage.completion_tokens == 3


# A dead front end is cleaned up and replaced --------------------------------------------------

def connection_owner(server_port: int, client_port: int, candidates: list[int]) -> int | None:
    """Which process holds the server side of the TCP connection from `client_port` (its socket
    inode in /proc/net/tcp, found among the candidates' open files)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, remote = int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)
                if local == server_port and remote == client_port:
                    inodes.add(fields[9])
    for pid in candidates:
        try:
            links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        except (FileNotFoundError, ProcessLookupError):
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            return pid
    return None


def owned_post(http_url: str, prompt: list[int], candidates: list[int]) -> tuple[int | None, bytes]:
    """POST /v1/next-token on a fresh connection: (the front end that held it, the raw answer)."""
    import socket

    host, port = http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        owner = None
        for _ in range(100):
            owner = connection_owner(int(port), sock.getsockname()[1], candidates)
            if owner is not None:
                break
            time.sleep(0.01)
        body = json.dumps({"prompt_token_ids": prompt, "top_k": 2}).encode()
        sock.sendall(b"POST /v1/next-token HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return owner, answer


_GPT2 = []


def tiny_gpt2_reference():
    """random:gpt2 (seed 0) in this process, loaded once."""
    if not _GPT2:
        from gpt2serve.engine.loading import load_model

        _GPT2.append(load_model("random:gpt2", "cpu", "float32", seed=0).model)
    return _GPT2[0]


class RawStream:
    """A streamed /v1/generate on its own TCP connection, so the test knows its client port."""

    def __init__(self, http_url: str, max_tokens: int):
        import socket

        host, port = http_url.removeprefix("http://").split(":")
        self.server_port = int(port)
        self.sock = socket.create_connection((host, self.server_port), timeout=120)
        self.port = self.sock.getsockname()[1]
        body = ('{"prompt": "A long story about the sea", "max_tokens": %d, "temperature": 0, "ignore_eos": true, '
                '"stream": true}' % max_tokens).encode()
        self.sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.received = b""

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.received:
            data = self.sock.recv(65536)
            if not data:
                break
            self.received += data
        return self.received

    def close(self) -> None:
        self.sock.close()


def test_kill_9_of_a_front_end_frees_its_slots_and_a_new_one_serves(tmp_path):
    """Under load (four long streams, two on each front end, every KV-cache slot taken, and
    next-token calls throughout), `kill -9` of one front end: the engine cancels its two streams
    at once (the slots are free within about a second), the other front end's streams and calls
    see no error, and the supervisor starts a new front end that serves."""
    srv = launch_server(tmp_path, "--model", "random:gpt2", "--workers", "2", "--max-running-sequences", "4",
                        "--max-queue-wait-s", "60")
    streams: list[RawStream] = []
    try:
        srv.wait_for_line(r"front-end\[\d+\].*front end listening(.|\n)*front-end\[\d+\].*front end listening")
        front_ends = pids(srv, "front-end")
        assert [open(f"/proc/{pid}/cmdline").read().startswith("gpt2serve: front end") for pid in front_ends] == \
            [True, True]
        (engine,) = pids(srv, "engine")
        assert open(f"/proc/{engine}/cmdline").read().startswith("gpt2serve: engine")
        owned: dict[int, list[RawStream]] = {pid: [] for pid in front_ends}
        for _ in range(40):  # connections land on either front end: keep two on each
            if all(len(s) == 2 for s in owned.values()):
                break
            stream = RawStream(srv.http_url, max_tokens=200)
            owner = None
            for _ in range(100):
                owner = connection_owner(stream.server_port, stream.port, front_ends)
                if owner is not None:
                    break
                time.sleep(0.01)
            if owner is None or len(owned[owner]) == 2:
                stream.close()
                continue
            stream.read_until(b"data:")  # it holds a slot now
            owned[owner].append(stream)
            streams.append(stream)
        assert all(len(s) == 2 for s in owned.values()), {pid: len(s) for pid, s in owned.items()}
        settled = time.monotonic() + 5  # the engine refreshes its gauges every 0.5 s
        while metric_value(srv.http_url, "gpt2serve_running_sequences") != 4 and time.monotonic() < settled:
            time.sleep(0.05)
        assert metric_value(srv.http_url, "gpt2serve_running_sequences") == 4
        victim, survivor = front_ends

        calls_ok, calls_failed = 0, []
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        # A connection the kernel queued on the victim's socket while it was dying is reset:
        # that call is the victim's. Calls start once its process is gone.
        while alive(victim) and time.monotonic() - killed < 5:
            time.sleep(0.01)
        freed_after = None
        while time.monotonic() - killed < 10:
            try:  # new connections, each served by the survivor (or the new front end once it serves)
                with Client(srv.grpc_target, timeout=30) as client:
                    client.next_token([464, 3139], top_k=2)
                calls_ok += 1
            except Gpt2ServeError as exc:
                calls_failed.append(exc)
            if freed_after is None and metric_value(srv.http_url, "gpt2serve_running_sequences") <= 2:
                freed_after = time.monotonic() - killed
            if freed_after is not None and calls_ok >= 10:
                break
        assert freed_after is not None and freed_after < 2.0, freed_after
        assert not calls_failed and calls_ok >= 10, calls_failed
        assert re.search(rf"front end {victim} is gone: cancelled its 2 request\(s\)", srv.log())

        for stream in owned[survivor]:  # the survivor's streams run to their end, untouched
            text = stream.read_until(b'"finish_reason":"length"')
            assert b'"finish_reason":"length"' in text and b"event: error" not in text
        deadline = time.monotonic() + 30
        while metric_value(srv.http_url, "gpt2serve_running_sequences") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric_value(srv.http_url, "gpt2serve_running_sequences") == 0
        assert metric_value(srv.http_url, "gpt2serve_kv_cache_usage_ratio") == 0

        srv.wait_for_line(r"starting front-end-\d again", timeout=30)
        while metric_value(srv.http_url, "gpt2serve_front_ends_up") != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric_value(srv.http_url, "gpt2serve_front_ends_up") == 2
        assert metric_value(srv.http_url, "gpt2serve_front_end_restarts_total") == 1
        (replacement,) = set(pids(srv, "front-end")) - {victim, survivor}
        assert open(f"/proc/{replacement}/cmdline").read().startswith("gpt2serve: front end")
        served_by_replacement = 0
        for i in range(60):  # until connections land on the new front end: it answers right
            owner, answer = owned_post(srv.http_url, [464, 3139 + i], [replacement, survivor])
            assert answer.startswith(b"HTTP/1.1 200"), answer
            result = json.loads(answer.split(b"\r\n\r\n", 1)[1])
            assert_matches_reference(tiny_gpt2_reference(), NextTokenResult.from_dict(result), [464, 3139 + i], 2)
            served_by_replacement += owner == replacement
            if served_by_replacement >= 2:
                break
        assert served_by_replacement >= 2
        assert srv.proc.poll() is None
    finally:
        for stream in streams:
            stream.close()
        assert srv.stop() == 0


def test_the_supervisor_names_prometheus_multiprocess_dir_as_metrics_does():
    """The supervisor sets it before importing prometheus_client, so it keeps its own copy."""
    from gpt2serve.launch import supervisor as processes
    from gpt2serve.telemetry import metrics

    assert processes.MULTIPROCESS_DIR_ENV == metrics.MULTIPROCESS_DIR_ENV
