"""A runner from a name, a model directory or a GGUF file: the top of the stack, using
every layer below.
"""
