"""Helpers of the SQL API tests: plain SQL on a psycopg connection, as any language sends it."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest

EMAIL = {"to": "ap@example.com", "subject": "October"}


def start_run(conn: psycopg.Connection[Any], **kw: Any) -> uuid.UUID:
    args = {"agent": "shop", "version": "1", "inputs": json.dumps({"order": 1}), **kw}
    named = ", ".join(f"{k} => %({k})s" for k in args)
    row = conn.execute(f"SELECT outbox_start_run({named})", args).fetchone()
    conn.commit()
    assert row is not None
    return uuid.UUID(str(row[0]))


def intend(conn: psycopg.Connection[Any], kind: str, payload: Any, **kw: Any) -> Any:
    args = {"kind": kind, "payload": json.dumps(payload), **kw}
    named = ", ".join(f"{k} => %({k})s" for k in args)
    return conn.execute(f"SELECT * FROM outbox_intend({named})", args).fetchone()


def sqlstate_of(call: Any) -> str:
    with pytest.raises(psycopg.Error) as caught:
        call()
    assert caught.value.sqlstate is not None
    return caught.value.sqlstate


def count(conn: psycopg.Connection[Any], table: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    assert row is not None
    return int(row[0])
