"""Errors raised while choosing, exporting or loading a draft engine."""

from __future__ import annotations


class DraftBackendError(RuntimeError):
    """The requested draft backend cannot serve this draft; the message says what to do."""


class MissingDependencyError(DraftBackendError, ImportError):
    """An optional package (onnxruntime, tensorrt, ...) is not installed."""


class BackendUnavailableError(DraftBackendError):
    """The backend's package is present but cannot run here (no GPU, no export, ...)."""


class ExportCheckError(DraftBackendError):
    """The exported step disagrees with PyTorch beyond the stated tolerance."""
