"""What HTTP costs a front end before any model work: three servers answer POST /v1/next-token
with a fixed JSON body, each in a process of its own on uvloop, loaded in turn by wrk (64
keep-alive connections, one thread), and each one's CPU a call is read from /proc:

- raw: a bare httptools parser in an asyncio protocol, one write an answer (Python's floor);
- uvicorn: uvicorn's httptools protocol and an ASGI app that reads the body and sends the answer
  (what an ASGI framework starts from);
- direct: the front end's own HTTP protocol (transport.http_connections, its connection limits
  and clock sweep) answering through transport.http_direct, the guard's checks and the body's
  pydantic parse included, with a route that returns the fixed answer (the HTTP share of a
  served REST next-token call).

    .venv/bin/python bench/host_path/http_floor.py [--rounds 2] [--seconds 8] [--servers raw,uvicorn,direct]

At saturation, so the event loop's wake-ups are shared by many calls: a floor, not a served figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

ANSWER = b'{"token_id":13,"token":".","logprob":-1.0,"top":[{"token_id":13,"token":".","logprob":-1.0}]}'
BODY = '{"prompt_token_ids":[464,3139,286,4881,318]}'
WRK_SCRIPT = f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{BODY}'
"""


class Raw(asyncio.Protocol):
    def __init__(self):
        import httptools
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(ANSWER), ANSWER))


async def asgi_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]})
    await send({"type": "http.response.body", "body": ANSWER})


def serve(kind: str, sock: socket.socket) -> None:
    """In the server's process: answer on `sock` until killed."""
    import uvicorn
    import uvloop
    if kind == "raw":
        async def main() -> None:
            server = await asyncio.get_running_loop().create_server(Raw, sock=sock)
            await server.serve_forever()
        uvloop.run(main())
        return
    protocol = "httptools"
    if kind == "direct":
        from gpt2serve.transport.guard import HttpGuard
        from gpt2serve.transport.http_connections import bounded_http_protocol
        from gpt2serve.transport.http_direct import DirectRoute, DirectRoutes
        from gpt2serve.transport.http_errors import HttpErrors
        from gpt2serve.transport.rest import NextTokenBody

        async def route(head, body) -> bytes:
            return ANSWER

        errors = HttpErrors(lambda *_: None, lambda _: "NextToken", ())
        guard = HttpGuard(asgi_app, key=None, max_body_bytes=1 << 20, metrics_open=True, errors=errors)
        direct = DirectRoutes({"/v1/next-token": DirectRoute(NextTokenBody, route)}, guard, errors,
                              lambda _: contextlib.nullcontext())
        protocol = bounded_http_protocol(1024, 30.0, lambda: None, lambda: None, direct)
    server = uvicorn.Server(uvicorn.Config(asgi_app, loop="uvloop", http=protocol, log_level="warning",
                                           access_log=False, lifespan="off"))
    uvloop.run(server.serve(sockets=[sock]))


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(kind: str, seconds: float) -> tuple[int, float]:
    """(calls wrk counted, server CPU microseconds a call)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    sock.set_inheritable(True)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/next-token"
    server = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--fd", str(sock.fileno())],
                              pass_fds=[sock.fileno()])
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".lua") as script:
            script.write(WRK_SCRIPT)
            script.flush()
            wrk = ["wrk", "-t1", "-c64", "-s", script.name, url]
            deadline = time.monotonic() + 60
            while subprocess.run([*wrk[:-1], "-d1s", "-c1", url], capture_output=True).returncode != 0:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"the {kind} server did not answer")
            subprocess.run([*wrk, "-d2s"], capture_output=True, check=True)  # warm-up
            before = cpu_s(server.pid)
            out = subprocess.run([*wrk, f"-d{int(seconds)}s"], capture_output=True, text=True, check=True).stdout
            used = cpu_s(server.pid) - before
    finally:
        server.kill()
        server.wait()
        sock.close()
    calls = int(next(line for line in out.splitlines() if "requests in" in line).split()[0])
    return calls, used / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--servers", default="raw,uvicorn,direct")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, socket.socket(fileno=args.fd))
    for round_ in range(1, args.rounds + 1):
        for kind in args.servers.split(","):
            calls, us = measure(kind, args.seconds)
            print(f"round {round_}: {kind:8s} {calls / args.seconds:8.0f} calls/s, {us:5.1f} us of CPU a call")


if __name__ == "__main__":
    main()
