"""The speculative core: the engine, the round, verification, sampling, drafters,
policies, constraints, the prefix cache and the ``Target`` protocol.

It knows nothing of HTTP, Redis or TensorRT, and builds no model: ``runtime`` does.
"""
