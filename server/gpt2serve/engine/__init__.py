"""Model execution: loading, tokenizing and batched forward passes. No telemetry, no transport."""
