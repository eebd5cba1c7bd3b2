"""A misspelled argument is reported under the method the caller called, with the one meant; no
call is sent (the targets here have no server)."""

from __future__ import annotations

import asyncio

import pytest

from gpt2serve_client import AsyncClient, Client, RestClient


@pytest.mark.parametrize("make, name", [(lambda: Client("127.0.0.1:9", timeout=1), "Client.generate"),
                                        (lambda: RestClient("127.0.0.1:9", timeout=1), "RestClient.generate")])
def test_a_misspelled_generate_option_names_generate(make, name):
    with pytest.raises(TypeError) as caught:
        make().generate("hi", temprature=0.5)
    assert str(caught.value) == f"{name}() got an unexpected keyword argument 'temprature'; did you mean 'temperature'?"


def test_the_async_client_too():
    async def call():
        async with AsyncClient("127.0.0.1:9", timeout=1) as client:
            await client.generate("hi", max_token=3)

    with pytest.raises(TypeError, match=r"AsyncClient.generate\(\) got an unexpected keyword argument 'max_token'; "
                                        r"did you mean 'max_tokens'\?"):
        asyncio.run(call())
