"""The engine client's implementations (protocol.EngineClient): in this process, or over IPC.

Nothing is imported here: a front-end process imports socket_client alone, and no torch with it.
"""
