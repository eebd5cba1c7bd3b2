"""`gpt2serve serve` that starts slowly, as a big model on a cold disk does (for test_starting_server.py):
its ports open LISTEN_DELAY_S late, then its model takes LOAD_DELAY_S more to load. Real server,
real ports; only the waits are added."""

import asyncio
import sys
import time

from gpt2serve.cli import main
from gpt2serve.launch import engine_host, front_end

LISTEN_DELAY_S = float(sys.argv.pop(1))
LOAD_DELAY_S = float(sys.argv.pop(1))
real_listen = front_end.FrontEnd.listen
real_start = engine_host.EngineHost.start


async def listen(self):
    time.sleep(LISTEN_DELAY_S)  # nothing listens yet: connections are refused
    await real_listen(self)


async def start(self):
    await asyncio.sleep(LOAD_DELAY_S)  # the ports are open; calls are answered "still loading"
    await real_start(self)


front_end.FrontEnd.listen = listen
engine_host.EngineHost.start = start
sys.exit(main())
