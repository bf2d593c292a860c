"""The runners: what a pass takes (passes, the core's contract), its layout, the decoder
layers' paths (PyTorch's, the native loop), the KV rows, the draft chain, and the two
runners (CausalLM: TransformersLM, BatchedLM).
"""
