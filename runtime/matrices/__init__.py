"""Matrices and their products: dense, block-quantized (int4, int8, Q4/Q8) and K-quant
weights, each multiplying the activations its way.
"""
