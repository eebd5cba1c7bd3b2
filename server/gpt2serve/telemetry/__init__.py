"""Telemetry: turns what the engine and scheduler report into spans (spans.py) and Prometheus metrics (metrics.py)."""
