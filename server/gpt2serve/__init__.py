"""gpt2serve: a GPT-2 next-token server (gRPC + REST) that shows its forward pass."""

__version__ = "0.1.0"
