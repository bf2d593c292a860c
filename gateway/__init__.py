"""OpenAI-compatible HTTP gateway and command line."""
