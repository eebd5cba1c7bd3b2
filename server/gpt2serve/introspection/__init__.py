"""Per-layer reports of a forward pass (hooks, computed on the device for traced rows)."""
