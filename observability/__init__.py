"""Metrics, tracing and structured logging."""
