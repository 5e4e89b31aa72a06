"""The ``outbox gc --archive`` file: every deleted row as a JSON line, on disk before the delete.

Format (JSON Lines, UTF-8, one object per line; a file may hold several ``gc``
runs, each starting with its header)::

    {"archive": "agent-outbox", "format": 1, "written_at": "...", "older_than_seconds": ...,
     "schema_version": 5}
    {"table": "outbox_runs", "row": {"id": "0190...", "status": "completed", ...}}
    {"table": "outbox_effects", "row": {...}}

``row`` holds every column of the deleted row under its column name: JSON
columns as JSON, UUIDs and timestamps (ISO 8601, with offset) as strings,
``numeric`` columns as strings (exact), everything else as itself.
:func:`read_archive` gives the rows back with those types restored.

Durability: :meth:`ArchiveWriter.sync` fsyncs the file (and, the first time,
its directory) and ``gc`` calls it before each delete commits, so a row gone
from the database is always in the archive. A crash between the two can leave
a row archived that was not deleted (the next ``gc`` archives it again); a
torn last line left by a crash while writing is skipped by the reader. The
file is created ``0600``: it holds payloads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO
from uuid import UUID

from sqlalchemy import DateTime, LargeBinary, Numeric, Table
from sqlalchemy.dialects.postgresql import UUID as PG_UUID

from outbox.errors import ValidationError
from outbox.storage.schema import metadata

__all__ = [
    "ARCHIVE_FORMAT",
    "ArchiveSummary",
    "ArchiveWriter",
    "ArchivedRow",
    "read_archive",
    "summarize_archive",
]

ARCHIVE_FORMAT = 1
_MARK = "agent-outbox"


def _encode(value: Any) -> Any:
    if isinstance(value, UUID | Decimal):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()  # the hash-chain links (BYTEA)
    raise TypeError(f"{type(value).__name__} is not archivable")


class ArchiveWriter:
    """Appends archive lines to one file; ``sync`` makes them durable."""

    def __init__(self, path: Path, handle: BinaryIO, *, created: bool) -> None:
        self.path = path
        self._handle = handle
        self._dir_pending = created

    @classmethod
    def open(cls, path: Path) -> ArchiveWriter:
        """Open ``path`` for appending, creating it ``0600`` when it does not exist."""
        path = Path(path)
        if not path.parent.is_dir():
            raise ValidationError("archive", str(path), "its directory does not exist")
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, flags)
            created = False
        except OSError as exc:
            raise ValidationError("archive", str(path), exc.strerror or str(exc)) from exc
        handle = os.fdopen(fd, "ab")
        if not created and path.stat().st_size > 0:
            with path.open("rb") as existing:
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    handle.write(b"\n")  # a torn line of a crashed run stays on its own
        return cls(path, handle, created=created)

    def header(self, **fields: Any) -> None:
        """Start a ``gc`` run's section of the file."""
        record = {"archive": _MARK, "format": ARCHIVE_FORMAT, **fields}
        self._handle.write(json.dumps(record, default=_encode).encode() + b"\n")

    def write(self, table: str, rows: Iterable[Mapping[str, Any]]) -> int:
        """Append the rows of ``table``; returns how many."""
        count = 0
        for row in rows:
            line = json.dumps({"table": table, "row": dict(row)}, default=_encode)
            self._handle.write(line.encode() + b"\n")
            count += 1
        return count

    def sync(self) -> None:
        """Flush and fsync; the first time, fsync the directory too (the new name)."""
        self._handle.flush()
        os.fsync(self._handle.fileno())
        if self._dir_pending:
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._dir_pending = False

    def close(self) -> None:
        """Sync and close."""
        if not self._handle.closed:
            self.sync()
            self._handle.close()

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- reading ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchivedRow:
    """One deleted row: its table and its columns, typed as the schema types them."""

    table: str
    row: dict[str, Any]

    def as_json(self) -> str:
        """The row as the archive line it came from (``{"table": ..., "row": ...}``)."""
        return json.dumps({"table": self.table, "row": self.row}, default=_encode)


@dataclass
class ArchiveSummary:
    """What an archive holds: the ``gc`` runs (headers), rows per table, torn lines skipped."""

    headers: list[dict[str, Any]] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    torn_lines: int = 0


def _decoder(table: Table | None, column: str) -> Any:
    if table is None or column not in table.c:
        return None
    kind = table.c[column].type
    if isinstance(kind, PG_UUID):
        return UUID
    if isinstance(kind, DateTime):
        return datetime.fromisoformat
    if isinstance(kind, Numeric):
        return Decimal
    if isinstance(kind, LargeBinary):
        return bytes.fromhex
    return None


def _typed(table_name: str, row: dict[str, Any]) -> dict[str, Any]:
    table = metadata.tables.get(table_name)
    out = {}
    for name, value in row.items():
        decode = _decoder(table, name)
        out[name] = value if value is None or decode is None else decode(value)
    return out


def _parse(raw: bytes) -> Any:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _entries(path: Path) -> Iterator[tuple[str, Any]]:
    """("header", dict) | ("row", ArchivedRow) | ("torn", line number), in file order."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise ValidationError("archive", str(path), exc.strerror or str(exc)) from exc
    with handle:
        broken: int | None = None  # a line that did not parse, judged by the line after it
        for number, raw in enumerate(handle, start=1):
            record = _parse(raw)
            if broken is not None:
                # Only a crash while writing leaves a broken line, and the next gc
                # starts with a header: anything else is not an archive we wrote.
                if record is None or record.get("archive") != _MARK:
                    raise ValidationError(
                        "archive", str(path), f"line {broken} is not a JSON object"
                    )
                yield "torn", broken
                broken = None
            if record is None:
                broken = number
                continue
            yield _classify(path, number, record)
        if broken is not None:
            yield "torn", broken


def _classify(path: Path, number: int, record: dict[str, Any]) -> tuple[str, Any]:
    if record.get("archive") == _MARK:
        if record.get("format") != ARCHIVE_FORMAT:
            raise ValidationError(
                "archive",
                str(path),
                f"line {number}: format {record.get('format')!r}, "
                f"this agent-outbox reads format {ARCHIVE_FORMAT}",
            )
        return "header", record
    table, row = record.get("table"), record.get("row")
    if isinstance(table, str) and isinstance(row, dict):
        return "row", ArchivedRow(table, _typed(table, row))
    raise ValidationError("archive", str(path), f"line {number} is not an archive line")


def read_archive(path: Path | str) -> Iterator[ArchivedRow]:
    """Every row in an archive, in the order it was written, with its column types restored."""
    for kind, value in _entries(Path(path)):
        if kind == "row":
            yield value


def summarize_archive(path: Path | str) -> ArchiveSummary:
    """The ``gc`` runs an archive holds and its rows per table."""
    summary = ArchiveSummary()
    for kind, value in _entries(Path(path)):
        if kind == "header":
            summary.headers.append(value)
        elif kind == "row":
            summary.rows[value.table] = summary.rows.get(value.table, 0) + 1
        else:
            summary.torn_lines += 1
    return summary
