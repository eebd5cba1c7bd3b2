"""Telemetry, beside every layer: each tells it what happened in a record (records.py), and it
turns them into spans (spans.py, tracing.py) and Prometheus metrics (metrics.py). It imports
none of the layers that report to it."""
