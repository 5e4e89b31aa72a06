"""Committed intents wake listeners: one inline NOTIFY, then one trailing NOTIFY per window."""

from __future__ import annotations

import time

import psycopg

from outbox import Outbox, Settings
from outbox.storage.sql.common import EFFECTS_CHANNEL


def _listen(dsn: str) -> psycopg.Connection:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute(f"LISTEN {EFFECTS_CHANNEL}")
    return conn


def _drain(conn: psycopg.Connection, seconds: float) -> list[float]:
    received = []
    for _ in conn.notifies(timeout=seconds):
        received.append(time.monotonic())
    return received


def test_a_lone_intent_notifies_at_commit(dsn: str) -> None:
    listener = _listen(dsn)
    ob = Outbox.connect(settings=Settings(dsn=dsn, notify_window_ms=200))
    try:
        run = ob.start_run("a", "1")
        run.transaction("s", lambda tx: tx.intend("email.send", {}) and None)
        committed = time.monotonic()
        received = _drain(listener, 0.1)
        assert len(received) == 1 and received[0] >= committed - 0.01
    finally:
        ob.close()
        listener.close()


def test_a_burst_costs_one_inline_and_one_trailing_notify(dsn: str) -> None:
    listener = _listen(dsn)
    ob = Outbox.connect(settings=Settings(dsn=dsn, notify_window_ms=300))
    try:
        run = ob.start_run("a", "1")
        for i in range(10):
            run.transaction(f"s{i}", lambda tx: tx.intend("email.send", {}) and None)
        last_commit = time.monotonic()
        received = _drain(listener, 1.0)
        assert len(received) == 2, "ten commits inside one window: leading + trailing"
        assert received[1] >= last_commit, "the trailing NOTIFY follows the last commit"
    finally:
        ob.close()
        listener.close()


def test_steps_without_intents_send_no_notify(dsn: str) -> None:
    listener = _listen(dsn)
    ob = Outbox.connect(settings=Settings(dsn=dsn, notify_window_ms=0))
    try:
        run = ob.start_run("a", "1")
        run.call("c", lambda: 1)
        run.transaction("t", lambda tx: tx.set_state({"a": 1}))
        assert _drain(listener, 0.2) == []
    finally:
        ob.close()
        listener.close()
