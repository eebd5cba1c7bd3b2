"""Load on the engine process alone, through its IPC door, for bench/host_path/host_path.py --ipc.

Client processes speak the engine's own protocol (gpt2serve.ipc.socket_client, as a front end
does) with nothing in front: no gRPC, no service, no tokenizer. On a machine with few cores
the front ends and the gRPC clients otherwise take most of the CPU, the engine runs small steps
(a 256-stream load kept ~14 sequences running on 2 cores), and its per-token figure measures
its fixed cost per step rather than its cost at full batch.

- streams: S generations of `new_tokens` tokens after 5-token prompts, greedy, past
  end-of-text, each started again as it ends;
- callers: C closed-loop next-token callers of `per_call` 5-token prompts a request (1: unary
  NextToken; 64: NextTokenBatch), top-5.

Each process returns what it received in its window (tokens or answers), and the first one
also the engine process's CPU seconds over its window (from /proc); the windows are of the same
length and open together within the spread of the processes' start-up.

`codec_table` (bench/host_path/host_path.py --codec) is the door's codec alone: a frame of one-prompt
next-token calls as a Submit and a Result each against the same calls in columns (a Prompts and
an Answers message), encode and decode per call (the decode builds each call's NextTokenOutput).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

from gpt2serve.ipc import codec
from gpt2serve.ipc.socket_client import SocketEngineClient
from gpt2serve.protocol import (Answers, GenerateRequest, NextTokenOutput, NextTokenRequest, Prompts, Result,
                                SamplingParams, Submit, TopScores, TraceContext)

GREEDY = SamplingParams(temperature=0.0)
TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """CPU seconds of the whole process (all threads, user + system); 0 for pid 0."""
    return sum(process_cpu_split(pid))


def process_cpu_split(pid: int) -> tuple[float, float]:
    """CPU seconds of the whole process (all threads): (user, system); zeros for pid 0."""
    if not pid:
        return 0.0, 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICKS, int(fields[12]) / TICKS


def _prompt(i: int) -> list[int]:
    return [100 + i % 1000, 200, 300, 400, 500]


async def _streams(address: str, engine_pid: int, first: int, streams: int, new_tokens: int, duration: float
                   ) -> tuple[int, float, list[float], float]:
    client = SocketEngineClient(address)
    await client.connect()
    received, counting, stop_at = [0], [False], [float("inf")]
    idle = asyncio.Event()
    live, failures = [0], []
    first_token_s: list[float] = []

    class Restart:
        def __init__(self, i: int):
            self.i, self.sent = i, time.perf_counter()

        def put(self, event) -> None:
            if self.sent:  # its first token: the time from sending the request (the engine's share of TTFT)
                if counting[0]:
                    first_token_s.append(time.perf_counter() - self.sent)
                self.sent = 0.0
            if counting[0]:
                received[0] += 1
            if event.finish_reason:
                live[0] -= 1
                if time.perf_counter() < stop_at[0]:
                    start(self.i)
                elif not live[0]:
                    idle.set()

        def fail(self, error) -> None:
            failures.append(error)  # reported after the window: a sink must not raise into the receive loop
            live[0] -= 1
            if not live[0]:
                idle.set()

    def start(i: int) -> None:
        live[0] += 1
        client.generate(GenerateRequest(_prompt(i), GREEDY, new_tokens, ignore_eos=True), Restart(i))

    for i in range(first, first + streams):
        start(i)
    await asyncio.sleep(min(1.0, duration / 4))  # every stream running before the window opens
    counting[0], cpu = True, process_cpu(engine_pid)
    await asyncio.sleep(duration)
    counting[0], cpu = False, process_cpu(engine_pid) - cpu
    stop_at[0] = time.perf_counter()
    await asyncio.wait_for(idle.wait(), 60)
    await client.close()
    if failures:
        raise RuntimeError(f"{len(failures)} generation(s) failed, the first: {failures[0]!r}")
    return received[0], cpu, first_token_s, 0.0


async def _callers(address: str, engine_pid: int, first: int, callers: int, per_call: int, duration: float
                   ) -> tuple[int, float, list[float], float]:
    client = SocketEngineClient(address)
    await client.connect()
    answered, steps, counting, stop_at = [0], [0.0], [False], [float("inf")]

    async def caller(i: int) -> None:
        request = NextTokenRequest([_prompt(i * per_call + j) for j in range(per_call)], 5)
        while time.perf_counter() < stop_at[0]:
            outputs = await client.next_token(request)
            if counting[0]:
                answered[0] += per_call
                steps[0] += sum(1 / o.batch_size for o in outputs)  # each forward counted once over its rows

    tasks = [asyncio.create_task(caller(i)) for i in range(first, first + callers)]
    await asyncio.sleep(min(1.0, duration / 4))
    counting[0], cpu = True, process_cpu(engine_pid)
    await asyncio.sleep(duration)
    counting[0], cpu = False, process_cpu(engine_pid) - cpu
    stop_at[0] = time.perf_counter()
    await asyncio.gather(*tasks)
    await client.close()
    return answered[0], cpu, [], steps[0]


def _in_process(kind: str, address: str, engine_pid: int, first: int, n: int, size: int, duration: float
                ) -> tuple[int, float, list[float], float]:
    if kind == "streams":
        return asyncio.run(_streams(address, engine_pid, first, n, size, duration))
    return asyncio.run(_callers(address, engine_pid, first, n, size, duration))


def from_processes(kind: str, address: str, engine_pid: int, n: int, size: int, duration: float,
                   processes: int) -> tuple[int, float, list[float], float]:
    """(units received in the windows, the engine's CPU seconds in the first one, each stream's
    seconds from sending its request to its first token in the windows, the forwards that
    answered callers' prompts in the windows, counted from each answer's batch size; 0 for
    streams): `kind` "streams" (`size` new tokens each) or "callers" (`size` prompts a
    request), n of them spread over `processes` processes."""
    processes = max(1, min(processes, n))
    shares = [n // processes + (i < n % processes) for i in range(processes)]
    firsts = [sum(shares[:i]) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        parts = pool.starmap(_in_process, [(kind, address, engine_pid if i == 0 else 0, first, share, size,
                                            duration) for i, (first, share) in enumerate(zip(firsts, shares))])
    return sum(p[0] for p in parts), parts[0][1], sorted(s for p in parts for s in p[2]), sum(p[3] for p in parts)


def _per_call_us(messages: list, calls: int, repeats: int) -> tuple[float, float]:
    started = time.perf_counter()
    for _ in range(repeats):
        frame = codec.encode(messages)
    encode = (time.perf_counter() - started) / repeats / calls * 1e6
    started = time.perf_counter()
    for _ in range(repeats):
        for message in codec.decode(frame):
            if type(message) is Answers:
                for _ in message.outputs():
                    pass
    return encode, (time.perf_counter() - started) / repeats / calls * 1e6


def codec_table(calls: int = 256, repeats: int = 300) -> str:
    """The codec's µs a call, one frame of `calls` one-prompt calls with top-5, as a table."""
    n = calls
    top = TopScores([262, 11, 5, 7, 9], [-1.5, -2.0, -3.0, -3.5, -4.0])
    requests = [NextTokenRequest([[464, 3139, 286, 4881, 318]], 5, TraceContext("00-ab-cd-00")) for _ in range(n)]
    loads = {
        "Submit each (front end -> engine)": [Submit(i, r) for i, r in enumerate(requests)],
        "Prompts, in columns": [Prompts(list(range(n)), [r.prompts[0] for r in requests], [5] * n)],
        "Result each (engine -> front end)": [Result(i, [NextTokenOutput(top, 0.001, 0.002, n, 10**18, 10**18 + 5)])
                                              for i in range(n)],
        "Answers, in columns": [Answers(list(range(n)), [top] * n, [0.001] * n, [10**18] * n, [], 0.002, n,
                                        10**18 + 5)],
    }
    lines = [f"| {n} one-prompt calls in a frame | encode µs a call | decode µs a call |", "|---|---|---|"]
    for name, messages in loads.items():
        encode, decode = _per_call_us(messages, n, repeats)
        lines.append(f"| {name} | {encode:.2f} | {decode:.2f} |")
    return "\n".join(lines)
