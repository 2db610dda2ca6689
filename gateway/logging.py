"""Logging: one formatter per `log_format` (JSON lines or console), with the request id on every record.

Log lines cannot be forged: a request path, header or body that reaches a message may hold CR/LF or terminal
escapes. JSON lines escape them by construction; the console format writes every control character (and the
backslash, so an escape cannot be faked) as a visible escape, and marks each line of a traceback with `  | `.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from contextvars import ContextVar
from typing import Any

import orjson

__all__ = ["JsonFormatter", "configure_logging", "request_id_var"]

# Set by the request-id middleware for the duration of a request, so every log line can carry it.
request_id_var: ContextVar[str | None] = ContextVar("unigate_request_id", default=None)

# Not copied into JSON lines: the record's own attributes, and uvicorn's `color_message` (its message again,
# with ANSI colour escapes for a terminal).
_STANDARD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "request_id", "color_message"}


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, and any `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


# C0 and C1 control characters, DEL, the Unicode line and paragraph separators, and the backslash itself.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
_TRACEBACK_MARK = "  | "  # starts every line of a record's exception text: none reads as a record of its own


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    return _ESCAPES.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def _escape(text: str) -> str:
    """`text` with control characters as visible escapes (`\\n`, `\\x1b`, `\\\\`): always one line."""
    return _UNSAFE.sub(_escape_char, text) if _UNSAFE.search(text) else text


class _ConsoleFormatter(logging.Formatter):
    """`time level logger: message [request id]`, one line per record (plus the marked lines of a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = _escape(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        request_id = getattr(record, "request_id", None)
        if request_id:
            line = f"{line} [{_escape(str(request_id))}]"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        for text in (record.exc_text, record.stack_info and self.formatStack(record.stack_info)):
            if text:
                line += "".join(f"\n{_TRACEBACK_MARK}{_escape(part)}" for part in text.splitlines())
        return line


def configure_logging(level: str = "info", log_format: str = "console") -> None:
    """Route our loggers and uvicorn's through one handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_ConsoleFormatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    for name in ("unigate", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # the metrics middleware logs one line per request
