"""`gpt2serve bench`: load against a server, and the in-process limits it is compared with.

    serving_load.py    next-token load over gRPC or REST (closed-loop clients, processes)
    engine_limit.py    the engine alone, in this process: the limit serving is measured against
    generate_load.py   streaming generation load, against transformers' generate in the same run
"""
