"""The ``specserve`` command line: the one place that wires serving, benchmarks,
training and the draft engines together."""
