"""What the request log costs a call, alone: `RequestTelemetry.finish` (the span ended, the metrics
counted, and with the log on, the line built and kept for the next flush, its share of the
flush's write included, which comes every FLUSH_LINES lines at this rate) timed with the request log on, failures only, and off, in alternating
rounds, against a front end's whole CPU a call from `front_end_profile.py`.

    .venv/bin/python bench/host_path/request_log_cost.py [--calls 200000] [--rounds 5] [--json]

The lines go to /dev/null, written as the server writes them (FLUSH_LINES at a time).
"""

from __future__ import annotations

import argparse
import time

import uvloop

from gpt2serve.telemetry.logs import RequestLog
from gpt2serve.telemetry.records import RequestOptions
from gpt2serve.telemetry.spans import Telemetry


async def us_a_call(telemetry: Telemetry, calls: int) -> float:
    """On an event loop, as in a front end: the lines wait there for the loop's flush."""
    options = RequestOptions(api="grpc", method="NextToken", span_name="gpt2serve.v1.Gpt2Serve/NextToken",
                             attributes={"rpc.system": "grpc"})
    spent = 0.0
    for _ in range(calls):
        request = telemetry.start_request(options)
        started = time.perf_counter()
        request.finish(prompt_tokens=5, output_tokens=1)
        spent += time.perf_counter() - started
    if telemetry.request_log is not None:
        telemetry.request_log.flush()
    return spent / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="--log-format json")
    args = parser.parse_args()
    with open("/dev/null", "w") as sink:
        kinds = {"off": None, "failures only": RequestLog(False, stream=sink),
                 "on": RequestLog(True, "json" if args.json else "text", stream=sink)}
        results: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind, request_log in kinds.items():
                telemetry = Telemetry()
                telemetry.request_log = request_log
                results[kind].append(uvloop.run(us_a_call(telemetry, args.calls)))
    for kind, times in results.items():
        print(f"{kind:>14}: {min(times):.2f} us a call (best of {args.rounds}; "
              f"rounds {', '.join(f'{t:.2f}' for t in times)})")
    print(f"the log's cost a call: {min(results['on']) - min(results['off']):.2f} us")


if __name__ == "__main__":
    main()
