"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1alpha` and
`grpc.reflection.v1` (grpcurl, Postman and grpcui ask v1 first). grpcio-reflection ships only
v1alpha's servicer; v1 is the same protocol under another package, with the same messages field
for field, so the one servicer answers both. v1's descriptor (v1alpha's, renamed) is added to the
default pool, so a client can describe the reflection service it is talking to."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
METHOD = "ServerReflectionInfo"


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """grpc.reflection.v1's file in the pool, made from v1alpha's (once; a no-op after)."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old_package = proto.package
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.Clear()  # v1alpha's options name its own Java and Go packages
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(f".{old_package}."):
                field.type_name = f".{V1_PACKAGE}." + field.type_name.removeprefix(f".{old_package}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old_package}.", f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(f".{old_package}.", f".{V1_PACKAGE}.")
    pool.Add(proto)


def service_names(*served: str) -> tuple[str, ...]:
    """What list_services answers: the services served, and reflection under both names."""
    register_v1_descriptor()
    return (*served, V1ALPHA_SERVICE, V1_SERVICE)


def enable_reflection(server: grpc.aio.Server, *served: str) -> None:
    """Both reflection services on a grpc.aio server, from one servicer."""
    servicer = reflection.aio.ReflectionServicer(service_names(*served))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo, request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(tuple(grpc.method_handlers_generic_handler(name, {METHOD: handler})
                                          for name in (V1ALPHA_SERVICE, V1_SERVICE)))
