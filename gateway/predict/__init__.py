"""A request's run on the engine: submit, the one event loop, the response."""
