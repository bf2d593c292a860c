"""The native kernels' build: the C++ sources (csrc/), compiled once per machine and loaded
for the host's instruction set.
"""
