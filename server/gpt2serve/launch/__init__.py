"""Start-up and shut-down, for every mode, as objects with start()/stop() that read as steps.

    single_process.py   --workers 1: a FrontEnd and an EngineHost in one process
    supervisor.py       --workers N: the Supervisor, N front-end processes and one engine process
    front_end.py        FrontEnd: transports + service over an engine client; listen, serve, drain
    engine_host.py      EngineHost: the model and its schedulers; load, warm, stop

Nothing is imported here: each process imports what its role needs, and a front-end process
never imports torch.
"""
