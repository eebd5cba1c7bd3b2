"""The floor under host cost per generated token: a bare grpc.aio servicer streaming a prebuilt
token message, with nothing else in the process. Prints the event-loop thread's CPU per message
while a client process runs 64 streams x 5 calls x 64 messages (the same shape as
generate_host_cost.py's load).

    .venv/bin/python bench/grpc_stream_floor.py
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc

from gpt2serve_client._proto import gpt2serve_pb2_grpc as pb_grpc
from gpt2serve_client.generation import GeneratedToken, GenerateChunk

MESSAGES, STREAMS, CALLS = 64, 64, 5
TOKEN = GenerateChunk(" the", GeneratedToken(262, " the", -0.5)).to_proto()
CLIENT = """
import asyncio, grpc, sys
from gpt2serve_client._proto import gpt2serve_pb2 as pb, gpt2serve_pb2_grpc as pb_grpc
async def main():
    async with grpc.aio.insecure_channel(sys.argv[1]) as channel:
        stub = pb_grpc.Gpt2ServeStub(channel)
        async def calls():
            for _ in range({calls}):
                async for _ in stub.Generate(pb.GenerateRequest()):
                    pass
        await asyncio.gather(*(calls() for _ in range({streams})))
asyncio.run(main())
""".format(calls=CALLS, streams=STREAMS)


class Streamer(pb_grpc.Gpt2ServeServicer):
    async def Generate(self, request, context):
        for _ in range(MESSAGES):
            yield TOKEN


async def main() -> None:
    server = grpc.aio.server()
    pb_grpc.add_Gpt2ServeServicer_to_server(Streamer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}"])
    started = time.thread_time()
    while client.poll() is None:
        await asyncio.sleep(0.05)
    spent = time.thread_time() - started
    print(f"grpc.aio streaming: {spent / (MESSAGES * STREAMS * CALLS) * 1e6:.0f} us of event-loop CPU per message")
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(main())
