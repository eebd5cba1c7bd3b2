"""Transports: gRPC and REST. They decode requests, call the service, encode results."""
