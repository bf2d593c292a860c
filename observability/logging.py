"""Structured logging: stdlib ``logging`` with one JSON object per line, uvicorn's
lines included (its loggers hand their records to ours), and the access lines of
health and readiness probes kept at debug, so that probes do not flood the log."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

REQUEST_LOGGER = "specserve.requests"
# Libraries that install handlers of their own: their records go through ours instead.
LIBRARY_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "transformers")
PROBE_PATHS = frozenset({"/health", "/ready"})
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Render a record as JSON: time, level, logger, message and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                payload[key] = value
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, default=str)


class AccessFields(logging.Filter):
    """uvicorn's access lines: their parts as fields (client, method, path, status), and
    probe requests demoted to debug (dropped unless the level is debug)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (isinstance(args, tuple) and len(args) == 5):
            return True
        client, method, path, _, status = args
        record.client, record.method, record.path, record.status = client, method, path, status
        if str(path).split("?", 1)[0] in PROBE_PATHS and record.levelno == logging.INFO:
            if not logging.getLogger().isEnabledFor(logging.DEBUG):
                return False
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def configure_logging(level: str = "info", json_lines: bool = True) -> None:
    """Send every log record to stderr, as JSON lines unless told otherwise; uvicorn's
    loggers propagate to the same handler (run uvicorn with ``log_config=None``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in LIBRARY_LOGGERS:
        library = logging.getLogger(name)
        library.handlers[:] = []
        library.propagate = True
    access = logging.getLogger("uvicorn.access")
    access.filters[:] = [f for f in access.filters if not isinstance(f, AccessFields)]
    access.addFilter(AccessFields())


def log_request(**fields: Any) -> None:
    """One line per finished request (request id, model, status, tokens, latency, ...).
    Prompt text is never passed here unless the operator enabled it."""
    logging.getLogger(REQUEST_LOGGER).info("request finished", extra=fields)
