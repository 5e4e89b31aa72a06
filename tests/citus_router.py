"""Does Citus run a statement on one shard? Run it on the coordinator and watch what it sends.

:func:`check_routing` executes a statement (text and parameters) on a
coordinator connection with ``citus.log_remote_commands`` and
``citus.log_local_commands`` on and ``client_min_messages = debug2``, collects
the commands Citus sends to the nodes (``issuing ...`` and ``executing the
command locally: ...`` notices) and the planner's own messages, and rolls the
transaction back. EXPLAIN alone would not do: it cannot show a function call
being delegated, nor the statements a function run on the coordinator routes
one by one (the round trips), nor a refusal that Citus raises only at execution.

Transaction control (``BEGIN``, ``assign_distributed_transaction_id``,
``PREPARE``/``COMMIT PREPARED``, ``COMMIT``) is not counted: a single-shard
statement is one that sends exactly one task, to one node. A delegated call is
one task (``SELECT f(...)``) whatever the function does on the worker.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import errors as pg_errors

Kind = Literal[
    "delegated function", "fast-path router", "router", "multi-task", "coordinator only", "error"
]

# Citus's planner messages (client_min_messages = debug1/debug2) that say how it planned.
DELEGATED = "pushing down the function call"
FAST_PATH = (
    "Distributed planning for a fast-path router query",
    "Deferred pruning for a fast-path router query",
)
ROUTER = "Creating router plan"
_NOISE = re.compile(r"^(parse|bind|execute) <", re.IGNORECASE)
_CONTROL = re.compile(
    r"^(BEGIN|COMMIT|ROLLBACK|PREPARE TRANSACTION|COMMIT PREPARED|ROLLBACK PREPARED|SAVEPOINT"
    r"|RELEASE SAVEPOINT|ROLLBACK TO SAVEPOINT|SELECT assign_distributed_transaction_id)\b",
    re.IGNORECASE,
)
_SERVER = re.compile(r"on server \S+@(\S+) connectionId")


@dataclass(frozen=True)
class NodeCommand:
    """One command Citus sent: ``node`` is ``host:port``, or ``local`` on the coordinator."""

    node: str
    sql: str


@dataclass(frozen=True)
class Routing:
    """What Citus did with one statement."""

    statement: str
    commands: tuple[NodeCommand, ...]
    planner: tuple[str, ...]
    error: str | None = None
    sqlstate: str | None = None
    control: tuple[NodeCommand, ...] = field(default=(), repr=False)

    @property
    def nodes(self) -> frozenset[str]:
        """The nodes the statement's tasks ran on."""
        return frozenset(command.node for command in self.commands)

    @property
    def delegated(self) -> bool:
        """The statement was a distributed function call pushed down to a worker."""
        return any(DELEGATED in line for line in self.planner)

    @property
    def single_shard(self) -> bool:
        """Exactly one task on one node, without an error: a router query or a delegated call."""
        return self.error is None and len(self.commands) == 1

    @property
    def kind(self) -> Kind:
        """A name for how Citus ran it (``single_shard`` is the test to rely on)."""
        if self.error is not None:
            return "error"
        if not self.commands:
            return "coordinator only"
        if len(self.commands) > 1:
            return "multi-task"
        if self.delegated:
            return "delegated function"
        if any(line.startswith(FAST_PATH) for line in self.planner):
            return "fast-path router"
        return "router"

    def explain(self) -> str:
        """A readable account for an assertion message."""
        lines = [f"{self.kind}: {self.statement}"]
        if self.error:
            lines.append(f"  error {self.sqlstate}: {self.error}")
        lines += [f"  planner: {line}" for line in self.planner]
        lines += [f"  -> {command.node}: {command.sql}" for command in self.commands]
        return "\n".join(lines)


def check_routing(
    conn: psycopg.Connection[Any],
    statement: str,
    params: Sequence[Any] | dict[str, Any] | None = None,
    *,
    rollback: bool = True,
) -> Routing:
    """Run ``statement`` on a coordinator connection and report where Citus sent it.

    ``conn`` must be in autocommit mode. With ``rollback`` (the default) the
    statement runs inside ``BEGIN ... ROLLBACK``, so nothing it writes stays;
    note that Citus delegates a function call inside a transaction block only
    when the function was distributed with ``force_delegation``. With
    ``rollback=False`` it runs on its own (autocommit) and its writes commit.
    A statement that fails is reported (``error``, ``sqlstate``), not raised.
    """
    if not conn.autocommit:
        raise ValueError("check_routing needs a connection in autocommit mode")
    sent: list[NodeCommand] = []
    control: list[NodeCommand] = []
    planner: list[str] = []

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        message = diag.message_primary or ""
        if diag.severity_nonlocalized == "DEBUG" or (diag.severity or "").startswith("DEBUG"):
            if not _NOISE.match(message):
                planner.append(message)
            return
        if message.startswith("issuing "):
            found = _SERVER.search(diag.message_detail or "")
            command = NodeCommand(found.group(1) if found else "?", message[len("issuing ") :])
        elif message.startswith("executing the command locally: "):
            command = NodeCommand("local", message[len("executing the command locally: ") :])
        else:
            return
        (control if _CONTROL.match(command.sql) else sent).append(command)

    settings = {
        "citus.log_remote_commands": "on",
        "citus.log_local_commands": "on",
        "client_min_messages": "debug2",
    }
    error: pg_errors.Error | None = None
    conn.add_notice_handler(on_notice)
    try:
        if rollback:
            with conn.transaction(force_rollback=True):
                _set(conn, settings, local=True)
                error = _execute(conn, statement, params, savepoint=True)
        else:
            _set(conn, settings, local=False)
            try:
                error = _execute(conn, statement, params, savepoint=False)
            finally:
                for name in settings:
                    conn.execute(f"RESET {name}")
    finally:
        conn.remove_notice_handler(on_notice)
    return Routing(
        statement=statement,
        commands=tuple(sent),
        planner=tuple(planner),
        error=None if error is None else error.diag.message_primary,
        sqlstate=None if error is None else error.sqlstate,
        control=tuple(control),
    )


def _set(conn: psycopg.Connection[Any], settings: dict[str, str], *, local: bool) -> None:
    for name, value in settings.items():
        conn.execute("SELECT set_config(%s, %s, %s)", [name, value, local])


def _execute(
    conn: psycopg.Connection[Any],
    statement: str,
    params: Sequence[Any] | dict[str, Any] | None,
    *,
    savepoint: bool,
) -> pg_errors.Error | None:
    # In a transaction, a savepoint keeps it usable after a refusal (the settings
    # are rolled back with the whole transaction, not with the savepoint).
    try:
        if savepoint:
            with conn.transaction():
                _run(conn, statement, params)
        else:
            _run(conn, statement, params)
    except pg_errors.Error as exc:
        return exc
    return None


def _run(
    conn: psycopg.Connection[Any], statement: str, params: Sequence[Any] | dict[str, Any] | None
) -> None:
    cursor = conn.execute(statement, params)
    if cursor.description is not None:
        cursor.fetchall()
