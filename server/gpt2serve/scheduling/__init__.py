"""Request scheduling: the queue between transports and the engine, and batch formation."""
