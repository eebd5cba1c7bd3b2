"""Steady gRPC load from one typed client over a `dns:` target, run as its own process: gRPC
reads GRPC_DNS_RESOLVER once per process, and only the c-ares resolver takes a DNS server from
the target. Prints {"ok": n, "errors": [...]} as JSON.

    python replica_load.py TARGET CALLS INTERVAL_S [pick_first|round_robin]
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["GRPC_DNS_RESOLVER"] = "ares"

from gpt2serve_client import Client, Gpt2ServeError  # noqa: E402 - after the resolver is chosen


def main() -> None:
    target, calls, interval_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    balancing = sys.argv[4] if len(sys.argv) > 4 else None
    ok, errors = 0, []
    with Client(target, timeout=20, load_balancing=balancing) as client:
        client.health(timeout=20)  # resolved and connected before the clock starts
        for i in range(calls):
            try:
                client.next_token([464, 3139, 286 + i % 1000], top_k=1)
                ok += 1
            except Gpt2ServeError as exc:
                errors.append(str(exc))
            time.sleep(interval_s)
    print(json.dumps({"ok": ok, "errors": errors}), flush=True)


if __name__ == "__main__":
    main()
