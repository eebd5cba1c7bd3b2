"""What the tests share, and nothing that is a test itself:

    servers.py            a real server process on ephemeral ports; /metrics readings
    reference.py          transformers as the judge: logprobs, layer reports, prompt scores
    generation.py         lively weights, prompts, transformers' greedy generate, staggered schedulers
    tracing.py            the layer-trace check; otlp_receiver.py, a real OTLP/gRPC receiver
    walkthrough.py        the walk-through's expected shapes from a config
    prometheus_server.py  Debian's Prometheus on loopback; dns_server.py, a DNS server on loopback
    fake_generator.py     a model runner for the core's next-token tests, no model; scheduler_events.py
    faulty_server.py      a server whose engine fails on cue (run as the server's entry)
    held_streams.py, replica_load.py   load that holds streams open, or balances over replicas
    lm_eval_tasks/        lm-evaluation-harness tasks; validate_crds.mjs, the chart's CRD check
"""
