"""Seeing the model: per-layer reports of a forward (probe.py, fed by engine.gpt2's explicit
ForwardTaps, computed on the device for traced rows only) and parameter counts from a model's
shape (params.py, `gpt2serve params`)."""
