"""``outbox migrate`` and ``outbox db status|start|stop``: the schema and the embedded server."""

from __future__ import annotations

import dataclasses

import click

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.embedded import EmbeddedServer
from outbox.migrate import applied_versions, migrate, shipped
from outbox.store import make_engine

__all__ = ["COMMANDS"]


@click.command("migrate")
@json_option
@pass_cli
def migrate_command(cli: CliContext, as_json: bool) -> None:
    """Apply pending migrations (idempotent; safe when run twice at once)."""
    from outbox.database import resolve_dsn

    dsn, _ = resolve_dsn(cli.settings)
    engine = make_engine(dsn)
    try:
        done = migrate(engine)
        with engine.connect() as conn:
            versions = applied_versions(conn)
    finally:
        engine.dispose()
    names = [f"{m.version:04d}_{m.name}" for m in done]
    report = {"applied": names, "schema_version": max(versions), "known": shipped()[-1].version}
    emit(
        report,
        as_json,
        lambda: console.print(
            f"applied {len(done)} migration(s): {', '.join(names) or 'none pending'}; "
            f"schema version {max(versions)}"
        ),
    )


@click.group("db")
def db() -> None:
    """Manage the embedded PostgreSQL (used when no OUTBOX_DSN is set)."""


def _server(cli: CliContext) -> EmbeddedServer:
    if cli.settings.dsn:
        raise click.UsageError("OUTBOX_DSN is set: the embedded server is not in use")
    return EmbeddedServer(cli.settings.home)


def _show_status(server: EmbeddedServer, as_json: bool) -> None:
    status = server.status()
    data = {
        k: (str(v) if v is not None and k == "home" else v)
        for k, v in dataclasses.asdict(status).items()
    }
    emit(
        data,
        as_json,
        lambda: table(
            "embedded PostgreSQL",
            ["field", "value"],
            [(k, "" if v is None else str(v)) for k, v in data.items()],
        ),
    )


@db.command("status")
@json_option
@pass_cli
def db_status(cli: CliContext, as_json: bool) -> None:
    """Show whether the embedded server is initialised and running, and its DSN."""
    _show_status(_server(cli), as_json)


@db.command("start")
@json_option
@pass_cli
def db_start(cli: CliContext, as_json: bool) -> None:
    """Start the embedded server (initialising it the first time) and migrate it."""
    server = _server(cli)
    with console.status("starting PostgreSQL…"):
        cli.outbox  # noqa: B018 -- connecting starts, attaches and migrates
    _show_status(server, as_json)


@db.command("stop")
@json_option
@pass_cli
def db_stop(cli: CliContext, as_json: bool) -> None:
    """Stop the embedded server."""
    stopped = _server(cli).stop()
    emit(
        {"stopped": stopped},
        as_json,
        lambda: console.print("stopped" if stopped else "was not running"),
    )


COMMANDS = [migrate_command, db]
