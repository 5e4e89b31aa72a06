"""CLI tables fit an 80-column terminal without breaking an id across lines."""

from __future__ import annotations

import io
import uuid

import pytest
from rich.console import Console

from outbox.cli import _common


def render(
    monkeypatch: pytest.MonkeyPatch, width: int, columns: list[str], rows: list[list[object]]
) -> str:
    out = io.StringIO()
    monkeypatch.setattr(_common, "console", Console(file=out, width=width, color_system=None))
    _common.table("effects", columns, rows)
    return out.getvalue()


COLUMNS = ["id", "status", "kind", "attempt", "step", "run", "key", "last error"]


def rows() -> list[list[object]]:
    return [
        [
            uuid.uuid4(),
            "pending",
            "http.request",
            1,
            "send-summary",
            _common.run_suffix(uuid.uuid4()),
            "361b5338aba344cf",
            "no deliverer is registered for kind http.request",
        ]
        for _ in range(3)
    ]


def test_an_80_column_table_keeps_every_id_whole_and_says_what_it_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = rows()
    text = render(monkeypatch, 80, COLUMNS, data)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for row in data:
        assert str(row[0]) in text, "an id is on one line, whole"
    assert "left out:" in text and "--json shows" in text
    assert "pending" in text and "http.request" in text, "the first columns stay"
    body = [line for line in text.splitlines() if str(data[0][0]) in line]
    assert len(body) == 1


def test_a_wide_terminal_shows_every_column(monkeypatch: pytest.MonkeyPatch) -> None:
    data = rows()
    text = render(monkeypatch, 200, COLUMNS, data)
    assert "left out" not in text
    assert all(name in text for name in ("last error", "send-summary", "no deliverer"))


def test_the_run_column_shows_the_random_end_of_a_run_id() -> None:
    """The first hex digits of a UUIDv7 are its time: the same for runs a minute apart."""
    first, second = (
        uuid.UUID("01a2361b-bdaf-750f-9f3e-ccc8be345107"),
        uuid.UUID("01a2361b-be26-7201-9afe-e379f060f294"),
    )
    assert _common.run_suffix(first) != _common.run_suffix(second)
    assert _common.run_suffix(first) == "…be345107" and _common.run_suffix(None) == ""
