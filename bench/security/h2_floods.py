"""The known HTTP/2 attacks (tests/support/h2_attacks.py) against a running gRPC port, one after
another, with a grpcio client making NextToken calls meanwhile; prints, per attack, the normal
client's p50 and failures and the GOAWAY codes the attacker was sent (docs/deploy.md's table).

    .venv/bin/python bench/security/h2_floods.py HOST:PORT [--seconds 3] [ATTACK ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.h2_attacks import ATTACKS, flood  # noqa: E402

from gpt2serve_client._proto import gpt2serve_pb2 as pb, gpt2serve_pb2_grpc as pb_grpc  # noqa: E402

CODES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR", 5: "STREAM_CLOSED",
         6: "FRAME_SIZE_ERROR", 9: "COMPRESSION_ERROR", 11: "ENHANCE_YOUR_CALM"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("attacks", nargs="*", default=list(ATTACKS))
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)
    print("| attack | normal calls | p50 | failed | attacker sent | connections |")
    print("|---|---|---|---|---|---|")
    for name in args.attacks:
        latencies, failures, stop = [], [], threading.Event()

        def normal() -> None:
            with grpc.insecure_channel(args.target, options=[("grpc.enable_retries", 0)]) as channel:
                stub = pb_grpc.Gpt2ServeStub(channel)
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        stub.NextToken(pb.NextTokenRequest(prompt="a normal call"), timeout=5)
                        latencies.append(time.monotonic() - started)
                    except grpc.RpcError as exc:
                        failures.append(exc.code().name)
                    time.sleep(0.05)

        thread = threading.Thread(target=normal)
        thread.start()
        outcome = flood(host, int(port), name, args.seconds)
        stop.set()
        thread.join()
        codes = ", ".join(f"GOAWAY {CODES.get(c, c)}" for c in sorted(set(outcome.goaways))) or "closed"
        p50 = f"{statistics.median(latencies) * 1000:.0f} ms" if latencies else "-"
        print(f"| {name} | {len(latencies)} | {p50} | {len(failures)} | {codes} | {outcome.connections} |", flush=True)


if __name__ == "__main__":
    main()
