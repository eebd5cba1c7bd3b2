"""Model execution: loading, tokenizing, batched next-token forwards (engine.py) and token-by-token
generation over a KV cache (generator.py). It knows no transport, no process and no scheduling
policy; it reports what it did in plain dataclasses, and the introspection probe rides along
when a row is traced."""
