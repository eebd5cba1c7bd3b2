"""Health, readiness, reflection, OpenAPI, and serving a checkpoint directory end to end."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from support.servers import launch_server
from support.reference import assert_matches_reference, transformers_random_model

from gpt2serve_client import Client, Gpt2ServeError, RestClient


def test_reflection_lists_and_describes_the_services(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"gpt2serve.v1.Gpt2Serve", "grpc.health.v1.Health"} <= services
        method_names = {m.name for m in
                        db.FindFileContainingSymbol("gpt2serve.v1.Gpt2Serve").service[0].method}
        assert method_names == {"NextToken", "NextTokenBatch", "GetModelInfo", "Generate", "Tokenize", "Detokenize",
                                "LoadAdapter", "UnloadAdapter", "ListAdapters"}


def v1_reflection(target: str, request_fields: dict):
    """One request of a reflection v1 client: its messages made from grpc.reflection.v1's own
    descriptor (registered by the server package, as a v1 client's generated code has it), on
    v1's path."""
    from google.protobuf import descriptor_pool, message_factory

    from gpt2serve.transport.grpc_reflection import register_v1_descriptor

    register_v1_descriptor()
    pool = descriptor_pool.Default()
    request_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest"))
    response_class = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse"))
    with grpc.insecure_channel(target) as channel:
        info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=request_class.SerializeToString,
                                     response_deserializer=response_class.FromString)
        (response,) = list(info(iter([request_class(**request_fields)]), timeout=10))
    return response


@pytest.mark.parametrize("grpc_server", ["builtin", "grpcio"])
def test_reflection_v1_for_a_v1_client(server, tmp_path, grpc_server):
    srv = server if grpc_server == "builtin" else launch_server(tmp_path, "--model", "random:tiny",
                                                                "--grpc-server", "grpcio")
    try:
        listed = v1_reflection(srv.grpc_target, {"list_services": ""})
        names = {s.name for s in listed.list_services_response.service}
        assert {"gpt2serve.v1.Gpt2Serve", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        from google.protobuf import descriptor_pb2

        for symbol, method in (("gpt2serve.v1.Gpt2Serve", "Generate"),
                               ("grpc.reflection.v1.ServerReflection", "ServerReflectionInfo")):
            found = v1_reflection(srv.grpc_target, {"file_containing_symbol": symbol})
            files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                     for b in found.file_descriptor_response.file_descriptor_proto]
            assert method in {m.name for f in files for service in f.service for m in service.method}, symbol
    finally:
        if srv is not server:
            srv.stop()


def test_grpc_health_for_the_named_service(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service="gpt2serve.v1.Gpt2Serve"), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_http_probes_and_openapi(server):
    assert httpx.get(f"{server.http_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.http_url}/readyz")
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    spec = httpx.get(f"{server.http_url}/openapi.json").json()
    assert {"/v1/next-token", "/v1/next-token/batch", "/v1/generate", "/v1/completions", "/v1/models", "/v1/model",
            "/healthz", "/readyz"} <= set(spec["paths"])
    assert "NextTokenResult" in spec["components"]["schemas"]
    docs = httpx.get(f"{server.http_url}/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


@pytest.mark.slow
def test_not_ready_while_the_model_loads(tmp_path):
    """Probes answer during loading: alive, not ready; inference says UNAVAILABLE."""
    srv = launch_server(tmp_path, "--model", "random:gpt2", wait_ready=False)
    try:
        seen_loading = False
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            alive = httpx.get(f"{srv.http_url}/healthz", timeout=5)
            ready = httpx.get(f"{srv.http_url}/readyz", timeout=5)
            assert alive.status_code == 200
            if ready.status_code == 200:
                break
            assert ready.status_code == 503
            if not seen_loading:
                seen_loading = True
                # Told not to wait for a starting server, the clients see what the server says.
                with Client(srv.grpc_target, wait_for_ready=False) as client:
                    assert client.health().status == "NOT_SERVING"
                    with pytest.raises(Gpt2ServeError) as refused:
                        client.next_token("hello")
                    assert refused.value.code == "UNAVAILABLE" and "loading" in refused.value.message
                with RestClient(srv.http_url, wait_for_ready=False) as rest:
                    assert rest.health().serving is False
            time.sleep(0.05)
        assert seen_loading, "never observed the loading state"
        with Client(srv.grpc_target) as client:
            assert client.health().serving
            assert client.model_info().parameters.total == 124_439_808
    finally:
        assert srv.stop() == 0


def test_serves_a_checkpoint_directory(tmp_path, tokenizer):
    saved = transformers_random_model(seed=5)
    saved.save_pretrained(tmp_path / "ckpt")
    srv = launch_server(tmp_path, "--model", str(tmp_path / "ckpt"))
    try:
        with Client(srv.grpc_target) as client:
            info = client.model_info()
            assert info.weights == "pretrained" and info.weights_source == str((tmp_path / "ckpt").resolve())
            prompt = "The capital of France is"
            assert_matches_reference(saved, client.next_token(prompt, top_k=5), tokenizer.encode(prompt), 5)
    finally:
        srv.stop()


def test_unloadable_model_exits_with_a_clear_message(tmp_path):
    srv = launch_server(tmp_path, "--model", str(tmp_path / "missing"), wait_ready=False)
    assert srv.proc.wait(timeout=60) == 1
    assert "cannot load model" in srv.log() and "no such checkpoint directory" in srv.log()
