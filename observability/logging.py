"""Structured logging: stdlib ``logging`` with one JSON object per line."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

REQUEST_LOGGER = "specserve.requests"
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


def configure_logging(level: str = "info", json_lines: bool = True) -> None:
    """Send every log record to stderr, as JSON lines unless told otherwise."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_request(**fields: Any) -> None:
    """One line per finished request (request id, model, status, tokens, latency, ...).
    Prompt text is never passed here unless the operator enabled it."""
    logging.getLogger(REQUEST_LOGGER).info("request finished", extra=fields)
