"""``outbox migrate`` and ``outbox db status|start|stop``: the schema and the embedded server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.storage.embedded import EmbeddedServer
from outbox.storage.engine import make_engine, resolve_dsn, translate_errors
from outbox.storage.migrate import applied_versions, migrate, shipped

__all__ = ["COMMANDS"]


@click.command("migrate")
@json_option
@pass_cli
def migrate_command(cli: CliContext, as_json: bool) -> None:
    """Apply pending migrations (idempotent; safe when run twice at once)."""
    dsn, _ = resolve_dsn(cli.settings)
    engine = make_engine(dsn)
    try:
        with translate_errors("migrating"):
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


@click.command("gc")
@click.option(
    "--older-than",
    required=True,
    metavar="DURATION",
    help="Finished history older than this goes, e.g. 30d, 12h.",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="Rows per transaction (short transactions keep vacuum working).",
)
@click.option(
    "--archive",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Append deleted runs and effects to this JSON-lines file first.",
)
@click.option(
    "--dry-run", is_flag=True, help="Count the first batch of each table; delete nothing."
)
@json_option
@pass_cli
def gc(
    cli: CliContext, older_than: str, batch: int, archive: Path | None, dry_run: bool, as_json: bool
) -> None:
    """Delete (or archive and delete) finished runs and effects older than a horizon."""
    from outbox.storage.retention import collect_garbage, open_archive, parse_horizon

    horizon = parse_horizon(older_than)
    if archive is not None and not archive.parent.is_dir():
        raise click.BadParameter(
            f"directory {str(archive.parent)!r} does not exist", param_hint="'--archive'"
        )
    handle = open_archive(archive)
    try:
        with console.status("collecting garbage…") as status:
            report = collect_garbage(
                cli.outbox.engine,
                horizon,
                batch=batch,
                archive=handle,
                dry_run=dry_run,
                progress=lambda table, n: status.update(f"{table}: {n} more"),
            )
    finally:
        if handle is not None:
            handle.close()
    data = {
        "older_than": older_than,
        "dry_run": dry_run,
        "deleted": report.deleted,
        "batches": report.batches,
    }
    emit(
        data,
        as_json,
        lambda: table(
            f"gc (older than {older_than}){' dry run' if dry_run else ''}",
            ["table", "deleted"],
            sorted(report.deleted.items()),
        ),
    )


COMMANDS = [migrate_command, db, gc]
