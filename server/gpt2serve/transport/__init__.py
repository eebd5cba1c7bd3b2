"""Transports: gRPC, REST and OpenAI-compatible routes, and the /ui page. They decode requests,
call the service, encode results, and map every error to its status in one place each
(grpc_server.abort_with, http_errors.HttpErrors)."""
