"""Seeing the model: per-layer reports of a forward (probe.py, fed by engine.gpt2's explicit
ForwardTaps, computed on the device for traced rows only), the shape walk-through of a forward
or of a preset (walkthrough.py), and the model families with their parameter counts
(architectures.py, params.py: `gpt2serve params`)."""
