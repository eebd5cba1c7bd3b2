"""The IPC codec's cost per next-token call, one frame of 256 one-prompt calls with top-5: as a
Submit and a Result each, against the same calls in columns (a Prompts message and an Answers
message). Encode and decode, per call; the decode includes building each call's NextTokenOutput.

    .venv/bin/python bench/ipc_codec.py [--calls 256] [--repeats 300]
"""

from __future__ import annotations

import argparse
import time

from gpt2serve.ipc import codec
from gpt2serve.protocol import (Answers, NextTokenOutput, NextTokenRequest, Prompts, Result, Submit, TopScores,
                                TraceContext)


def per_call_us(messages: list, calls: int, repeats: int) -> tuple[float, float]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    n = args.calls
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
    print(f"| {n} one-prompt calls in a frame | encode µs a call | decode µs a call |")
    print("|---|---|---|")
    for name, messages in loads.items():
        encode, decode = per_call_us(messages, n, args.repeats)
        print(f"| {name} | {encode:.2f} | {decode:.2f} |")


if __name__ == "__main__":
    main()
