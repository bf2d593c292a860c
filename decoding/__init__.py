"""The decoding core: target, drafters, verification, scheduling.

This package knows nothing about HTTP, Redis or TensorRT.
"""
