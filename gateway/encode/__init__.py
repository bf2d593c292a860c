"""From the engine's events to OpenAI bodies and chunks."""
