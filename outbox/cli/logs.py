"""Logging set-up for the daemons: structured fields (run, effect, key, attempt) in every line."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

__all__ = ["FIELDS", "configure"]

FIELDS = ("run_id", "effect_id", "key", "attempt", "kind", "worker")


class _Text(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [f"{name}={getattr(record, name)}" for name in FIELDS if hasattr(record, name)]
        return f"{line} [{' '.join(extras)}]" if extras else line


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update({name: getattr(record, name) for name in FIELDS if hasattr(record, name)})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: int = logging.INFO, *, as_json: bool = False) -> None:
    """Send logs to stderr, as text with the structured fields appended, or as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _Json() if as_json else _Text("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
