"""The OpenAI wire shapes: requests, bodies, events and errors, as pydantic models."""
