"""The REST next-token route's own CPU in one process, the engine's answer canned: what a front
end spends on a call between the HTTP parser and the socket write, without the HTTP layer, the
IPC or the event loop's I/O (bench/host_path/front_end_profile.py measures the whole of it, served).

It runs the route as the front end's HTTP protocol does (transport.http_direct: a DirectCall
the guard has checked, the body parsed, the service's next-token call, the answer's JSON) under
InferenceService.accepted, against an engine client that answers at once with a top 5.

    .venv/bin/python bench/host_path/rest_route_cost.py [--calls 20000] [--rounds 3] [--json]

Prints the CPU microseconds a call in each round (process time, after a warm-up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from gpt2serve.config import ServeConfig
from gpt2serve.engine.tokenizer import load_tokenizer
from gpt2serve.protocol import NextTokenOutput, NextTokenRequest, TokenScore
from gpt2serve.service import InferenceService
from gpt2serve.telemetry.spans import Telemetry
from gpt2serve.transport.http_direct import DirectCall, DirectRoutes
from gpt2serve.transport.rest import create_app
from gpt2serve_client.types import Architecture, ModelInfo, ParameterBreakdown

ROUTE = "/v1/next-token"
BODY = b'{"prompt_token_ids":[464,3139,286,4881,318]}'


class CannedEngine:
    """An engine client that answers every prompt at once: token 13 and the next ones down."""

    max_batch_size = 256

    async def next_token(self, request: NextTokenRequest) -> list[NextTokenOutput]:
        now = time.time_ns()
        return [NextTokenOutput([TokenScore(13 + rank, -1.0 - rank) for rank in range(request.top_k)],
                                0.001, 0.002, 64, now, now) for _ in request.prompts]


HEADERS = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
           (b"content-length", str(len(BODY)).encode()), (b"user-agent", b"bench")]


def direct_call(direct: DirectRoutes) -> DirectCall:
    """The call as the protocol hands it over: the head checked by the guard, the body whole."""
    call = DirectCall(None, ROUTE, list(HEADERS), "http", keep_alive=True, expect_100=False)
    call.parts.append(BODY)
    call.size, call.complete = len(BODY), True
    call.refusal = direct.refusal(call)
    return call


def ready_service() -> InferenceService:
    config = ServeConfig()
    service = InferenceService(config, Telemetry())
    architecture = Architecture(n_layer=2, n_head=2, d_model=64, d_head=32, d_mlp=256, n_ctx=1024, vocab_size=50257)
    info = ModelInfo("random:tiny", "random", "", "float32", "cpu", architecture, ParameterBreakdown(*[0] * 8),
                     max_prompt_tokens=1024, max_batch_size=256)
    service.attach(load_tokenizer(None), info, CannedEngine())
    service.ready = True
    return service


async def rounds(calls: int, count: int) -> tuple[list[float], dict]:
    service = ready_service()
    _, direct = create_app(service, service.config)

    async def one() -> tuple[int, bytes]:
        with service.accepted(f"POST {ROUTE}"):
            status, _, body = await direct.answer(direct_call(direct))
        return status, body

    status, body = await one()
    answer = json.loads(body)
    if status != 200 or answer["token_id"] != 13 or len(answer["top"]) != 5:
        raise SystemExit(f"the route answered {status}: {body[:300]!r}")
    for _ in range(min(calls, 2000)):  # warm-up: caches, the series' children
        await one()
    per_call = []
    for _ in range(count):
        started = time.process_time()
        for _ in range(calls):
            await one()
        per_call.append((time.process_time() - started) / calls * 1e6)
    return per_call, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    per_call, answer = asyncio.run(rounds(args.calls, args.rounds))
    if args.json:
        print(json.dumps({"us_per_call": per_call, "answer": answer}))
    else:
        print("REST /v1/next-token route in process, engine canned: "
              + " / ".join(f"{us:.1f}" for us in per_call) + " us of CPU a call")


if __name__ == "__main__":
    main()
