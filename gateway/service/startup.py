"""Configuration errors at start-up, as one clear line and a non-zero exit.

``check_settings`` finds what can be found before anything loads (a model path
that is not there or not readable); ``one_line`` turns a settings validation error
or a loader's exception into the line printed on stderr.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from gateway.service.settings import ENV_PREFIX, Settings
from wiring.drafts import AUTO, CHEAP_DRAFTS, draft_parts

BUILTIN_DRAFTS = frozenset({*CHEAP_DRAFTS, AUTO, "default-draft"})
# Loaders raise these for a wrong path, a missing package or an unusable model or
# draft; anything else is a bug and keeps its traceback.
CONFIG_ERRORS: tuple[type[BaseException], ...] = (OSError, ImportError, ValueError,
                                                  RuntimeError)


class StartupError(Exception):
    """A setting that cannot work, found before the models load."""


def _path_like(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~"))


def _check_path(what: str, spec: str) -> None:
    path = Path(spec).expanduser()
    if not path.exists():
        raise StartupError(f"the {what} {spec!r} does not exist")
    if not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise StartupError(f"the {what} {spec!r} is not readable")


BACKEND_PACKAGES = {"tensorrt": ("tensorrt", "pip install tensorrt (NVIDIA's package index, "
                                              "on a machine with an NVIDIA GPU)"),
                    "onnx": ("onnxruntime", "pip install 'specserve[onnx]'")}


def check_settings(settings: Settings) -> None:
    """Model and draft paths that are missing or unreadable (hub ids are not checked),
    and the package a draft backend asked for by name."""
    needed = BACKEND_PACKAGES.get(settings.draft_backend)
    if needed is not None and importlib.util.find_spec(needed[0]) is None:
        raise StartupError(f"--draft-backend {settings.draft_backend} needs the {needed[0]} "
                           f"package, which is not installed: {needed[1]}, or choose "
                           "another backend")
    if _path_like(settings.target):
        _check_path("target model", settings.target)
    for part in draft_parts(settings.draft):
        if part not in BUILTIN_DRAFTS and _path_like(part):
            _check_path("draft", part)


def one_line(exc: BaseException) -> str:
    """The error as one line: each invalid setting with its flag and variable."""
    if isinstance(exc, ValidationError):
        parts = []
        for error in exc.errors():
            name = ".".join(str(p) for p in error["loc"])
            where = (f"{name} (--{name.replace('_', '-')}, {ENV_PREFIX}{name.upper()}): "
                     if name else "")
            parts.append(where + error["msg"])
        return "invalid settings: " + "; ".join(parts)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def fail(command: str, exc: BaseException, status: int = 2) -> int:
    """Print ``exc`` as one line on stderr; return the exit status."""
    print(f"{command}: error: {one_line(exc)}", file=sys.stderr, flush=True)
    return status
