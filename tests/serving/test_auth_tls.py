"""API keys and TLS on both transports, with the shipped clients and with raw requests."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys

import grpc
import httpx
import pytest
import trustme
from support.servers import launch_server, requests_total
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpt2serve.transport.guard import BearerKey
from gpt2serve_client import Client, Gpt2ServeError, RestClient

KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("auth"), "--model", "random:tiny", env={"GPT2SERVE_API_KEY": KEY})
    yield srv
    srv.stop()


def test_bearer_key_matching():
    key = BearerKey(KEY)
    assert key.accepts(f"Bearer {KEY}") and key.accepts(f"bearer {KEY}".encode()) and key.accepts(f" Bearer  {KEY} ")
    for wrong in (None, "", KEY, f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", "Bearer", "Bearer \udcff"):
        assert not key.accepts(wrong), wrong


def test_grpc_requires_the_key_and_probes_stay_open(keyed_server):
    before = requests_total(keyed_server.http_url, "grpc", "NextToken", "UNAUTHENTICATED")
    for api_key in (None, "wrong"):
        with Client(keyed_server.grpc_target, api_key=api_key) as client, pytest.raises(Gpt2ServeError) as error:
            client.next_token("hi")
        assert error.value.code == "UNAUTHENTICATED" and "Bearer" in error.value.message
    with Client(keyed_server.grpc_target, api_key=KEY) as client:
        assert client.next_token("hi", top_k=2).token_id >= 0
        assert client.model_info().model == "random:tiny"
    with grpc.insecure_channel(keyed_server.grpc_target) as channel:  # no key: health still answers
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    assert requests_total(keyed_server.http_url, "grpc", "NextToken", "UNAUTHENTICATED") == before + 2


def test_rest_requires_the_key_and_probes_stay_open(keyed_server):
    url = keyed_server.http_url
    before = requests_total(url, "rest", "NextToken", "UNAUTHENTICATED")
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        response = httpx.post(f"{url}/v1/next-token", json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 401, response.text
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "UNAUTHENTICATED"
    assert httpx.get(f"{url}/v1/model").status_code == 401
    ok = httpx.post(f"{url}/v1/next-token", json={"prompt": "hi"}, headers={"authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text
    for open_path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert httpx.get(f"{url}{open_path}").status_code == 200, open_path
    assert requests_total(url, "rest", "NextToken", "UNAUTHENTICATED") == before + 3
    with RestClient(url, api_key=KEY) as client:
        assert client.next_token("hi", top_k=2).token_id >= 0 and client.health().serving
    with RestClient(url) as client, pytest.raises(Gpt2ServeError) as error:
        client.next_token("hi")
    assert error.value.code == "UNAUTHENTICATED" and error.value.http_status == 401


# Kept where the package is found through PYTHONPATH rather than installed (the GPU machine).
PYTHONPATH = {"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}


def test_the_key_is_never_printed(keyed_server):
    assert KEY not in keyed_server.log()
    helped = subprocess.run([sys.executable, "-m", "gpt2serve.cli", "serve", "--help"], capture_output=True,
                            text=True, env={"GPT2SERVE_API_KEY": KEY, "PATH": "/usr/bin:/bin", **PYTHONPATH}, check=True)
    assert "--api-key" in helped.stdout and KEY not in helped.stdout


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, ca):
    tmp = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(tmp / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / "cert.pem"))
    for extra in cert.cert_chain_pems[1:]:
        with open(tmp / "cert.pem", "ab") as chain:
            chain.write(extra.bytes())
    srv = launch_server(tmp, "--model", "random:tiny", "--tls-cert", str(tmp / "cert.pem"),
                        "--tls-key", str(tmp / "key.pem"), "--api-key", KEY, "--metrics-require-key")
    yield srv
    srv.stop()


def test_grpc_over_tls(tls_server, ca):
    roots = ca.cert_pem.bytes()
    with Client(tls_server.grpc_target, api_key=KEY, root_certificates=roots) as client:
        assert client.next_token("over TLS", top_k=2).token_id >= 0
    for client in (Client(tls_server.grpc_target, api_key=KEY, timeout=3, retries=0),  # plaintext to a TLS port
                   Client(tls_server.grpc_target, api_key=KEY, tls=True, timeout=3, retries=0)):  # untrusted CA
        with client, pytest.raises(Gpt2ServeError) as error:
            client.next_token("hi")
        assert error.value.code == "UNAVAILABLE"
    with Client(tls_server.grpc_target, root_certificates=roots) as client, pytest.raises(Gpt2ServeError) as error:
        client.next_token("hi")
    assert error.value.code == "UNAUTHENTICATED"


def test_https_and_protected_metrics(tls_server, ca, tmp_path):
    assert tls_server.http_url.startswith("https://")
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with RestClient(tls_server.http_url, api_key=KEY, root_certificates=str(ca_file)) as client:
        assert client.next_token("over HTTPS", top_k=2).token_id >= 0
    verify = ssl.create_default_context(cafile=str(ca_file))
    assert httpx.get(f"{tls_server.http_url}/healthz", verify=verify).status_code == 200
    assert httpx.get(f"{tls_server.http_url}/metrics", verify=verify).status_code == 401
    protected = httpx.get(f"{tls_server.http_url}/metrics", verify=verify, headers={"authorization": f"Bearer {KEY}"})
    assert protected.status_code == 200 and "gpt2serve_requests_total" in protected.text
    with pytest.raises(httpx.ConnectError):  # the system roots do not trust our CA
        httpx.get(f"{tls_server.http_url}/healthz")
    plain = tls_server.http_url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/healthz")


def test_generation_and_the_openai_api_need_the_key(keyed_server):
    import openai

    with pytest.raises(Gpt2ServeError) as err:
        Client(keyed_server.grpc_target, retries=0).generate("hi", max_tokens=2)
    assert err.value.code == "UNAUTHENTICATED"
    with Client(keyed_server.grpc_target, api_key=KEY) as client:
        assert client.generate("hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.http_url}/v1", api_key="wrong", max_retries=0).models.list()
    oai = openai.OpenAI(base_url=f"{keyed_server.http_url}/v1", api_key=KEY, max_retries=0)
    model = oai.models.list().data[0].id
    assert oai.completions.create(model=model, prompt="hi", max_tokens=3).usage.completion_tokens <= 3
