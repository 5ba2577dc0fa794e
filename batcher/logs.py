"""Logging set-up shared by every command: stdlib logging, as text or JSON lines."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

FORMATS = ("text", "json")

#: The request-scoped fields a log call may pass (`extra={"trace_id": ..., ...}`), written
#: as they are on a JSON line.
CONTEXT_FIELDS = ("trace_id", "span_id", "request_id", "model")


def _current_span_ids() -> tuple[str, str] | None:
    """The trace and span id of OpenTelemetry's current span, when opentelemetry is
    already loaded (this never imports it) and the span is a valid one."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    try:
        ctx = trace.get_current_span().get_span_context()
    except Exception:  # a broken or partial opentelemetry: no ids, never a failed log line
        return None
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers: time, level, logger, message, and the
    trace and span id where there is one (given with the call, or OpenTelemetry's current
    span), the request id and model on request-scoped lines, so a line joins its trace."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        given = record.__dict__
        for key in CONTEXT_FIELDS:
            value = given.get(key)
            if value is not None:
                entry[key] = value if isinstance(value, int | float | str) else str(value)
        if "trace_id" not in entry and (ids := _current_span_ids()) is not None:
            entry["trace_id"], entry["span_id"] = ids
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Send logs to stderr at `level`, as `text` or `json`."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
