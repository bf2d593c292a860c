"""From a validated request to the engine's work: parameters, prompts, tools and grammar."""
