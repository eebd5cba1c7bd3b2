"""Telemetry: turns what the engine and scheduler report into spans (and, later, metrics)."""
