"""A real OTLP/gRPC trace receiver (opentelemetry-proto's TraceService) for tests."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def any_value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    links: list[tuple[str, str]]  # (trace id, span id)
    status_code: int
    resource: dict = field(default_factory=dict)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {kv.key: any_value(kv.value) for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        self.spans.append(ReceivedSpan(
                            name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                            start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                            attributes={kv.key: any_value(kv.value) for kv in s.attributes},
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            status_code=s.status.code, resource=resource,
                        ))
        return trace_service_pb2.ExportTraceServiceResponse()

    def exporter_env(self) -> dict[str, str]:
        """Environment for a server that should export its spans here."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true"}

    def server_env(self) -> dict[str, str]:
        """What the tracing tests' servers run with: export here, quickly, under a known name."""
        return {**self.exporter_env(), "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "gpt2serve-under-test",
                "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans of one trace, once every name in `names` has arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.05)
        raise TimeoutError(f"trace {trace_id}: have {sorted({s.name for s in self.trace(trace_id)})}, want {sorted(names)}")
