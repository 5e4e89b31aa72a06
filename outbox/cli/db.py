"""``outbox migrate`` and ``outbox db status|start|stop``: the schema and the embedded server."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

import click

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.cli.reports import (
    ArchiveSummaryReport,
    DbStatusReport,
    DbStopReport,
    GcReport,
    MigrateReport,
)

if TYPE_CHECKING:  # storage is imported by the commands that run, not by their --help
    from outbox.storage.admin.embedded import EmbeddedServer

__all__ = ["COMMANDS"]


@click.command("migrate")
@click.option(
    "--accept-changed",
    "accept_changed",
    type=click.IntRange(1),
    multiple=True,
    metavar="VERSION",
    help="Accept that applied migration VERSION differs from the shipped file "
    "(after checking the database matches it); records the new checksum.",
)
@click.option(
    "--to",
    "target",
    type=click.IntRange(1),
    default=None,
    metavar="VERSION",
    help="Apply migrations up to this version only.",
)
@click.option(
    "--distribute",
    is_flag=True,
    help="On a Citus coordinator: distribute the tables by shard and delegate the step "
    "write to the node holding each run (docs/howto/citus.md). Idempotent.",
)
@json_option(MigrateReport)
@pass_cli
def migrate_command(
    cli: CliContext,
    accept_changed: tuple[int, ...],
    target: int | None,
    distribute: bool,
    as_json: bool,
) -> None:
    """Apply pending migrations (idempotent; safe when run twice at once).

    An applied migration whose shipped file changed since is refused by name
    (a checksum is recorded for each); a failing migration is named with the
    server's reason.
    """
    from outbox.storage.engine import make_engine, resolve_dsn, translate_errors
    from outbox.storage.migrate import applied_versions, migrate, shipped

    dsn, _ = resolve_dsn(cli.settings)
    engine = make_engine(dsn)
    distributed: list[str] = []
    try:
        done = migrate(engine, accept_changed=accept_changed, target=target)
        if distribute:
            from outbox.storage.citus import distribute as distribute_tables

            with console.status("distributing the tables…"):
                distributed = distribute_tables(engine).distributed
        with translate_errors("reading the schema version"), engine.begin() as conn:
            versions = applied_versions(conn)
    finally:
        engine.dispose()
    names = [m.label for m in done]
    report = MigrateReport(
        applied=names,
        schema_version=max(versions),
        known=shipped()[-1].version,
        distributed=distributed,
    )
    emit(
        report,
        as_json,
        lambda: console.print(
            f"applied {len(done)} migration(s): {', '.join(names) or 'none pending'}; "
            f"schema version {max(versions)}"
            + (f"; distributed {len(distributed)} table(s)" if distribute else "")
        ),
    )


@click.group("db")
def db() -> None:
    """Manage the embedded PostgreSQL (used when no OUTBOX_DSN is set)."""


def _server(cli: CliContext) -> EmbeddedServer:
    from outbox.storage.admin.embedded import EmbeddedServer

    if cli.settings.dsn:
        raise click.UsageError("OUTBOX_DSN is set: the embedded server is not in use")
    return EmbeddedServer(cli.settings.home)


def _show_status(server: EmbeddedServer, as_json: bool) -> None:
    status = server.status()
    report = DbStatusReport(**{**dataclasses.asdict(status), "home": str(status.home)})
    emit(
        report,
        as_json,
        lambda: table(
            "embedded PostgreSQL",
            ["field", "value"],
            [(k, "" if v is None else str(v)) for k, v in report.model_dump().items()],
        ),
    )


@db.command("status")
@json_option(DbStatusReport)
@pass_cli
def db_status(cli: CliContext, as_json: bool) -> None:
    """Show whether the embedded server is initialised and running, and its DSN."""
    _show_status(_server(cli), as_json)


@db.command("start")
@json_option(DbStatusReport)
@pass_cli
def db_start(cli: CliContext, as_json: bool) -> None:
    """Start the embedded server (initialising it the first time) and migrate it."""
    server = _server(cli)
    with console.status("starting PostgreSQL…"):
        cli.outbox  # noqa: B018 -- connecting starts, attaches and migrates
    _show_status(server, as_json)


@db.command("stop")
@json_option(DbStopReport)
@pass_cli
def db_stop(cli: CliContext, as_json: bool) -> None:
    """Stop the embedded server."""
    stopped = _server(cli).stop()
    emit(
        DbStopReport(stopped=stopped),
        as_json,
        lambda: console.print("stopped" if stopped else "was not running"),
    )


GC_HELP = """Delete (or archive and delete) finished history older than a horizon.

\b
What goes: runs that ended before the horizon with no open effect, with
their steps, effects, attempt log, signals and budget ledger; run-less
effects finished before it, with their attempts; consumer dedup keys and
webhook replay marks older than it; then the large values stored by reference
(outbox_blobs) that nothing refers to any more, whatever their age. Each
batch is one short transaction. On Citus, a shard whose node does not answer
is left for the next gc and named (exit 1); the other shards are collected.

\b
--archive FILE appends every deleted row of every table to FILE (created
0600) as JSON lines, fsynced before the batch's delete commits:
  {"archive": "agent-outbox", "format": 1, ...}     one header per gc run
  {"table": "outbox_runs", "row": {...every column...}}
Rows of a batch come parents first (a run, its steps, signals, ledger,
effects, then their attempts). Read it back with `outbox archive read FILE`
or outbox.storage.admin.archive.read_archive (docs/howto/retention-and-migrations.md).
"""


@click.command("gc", help=GC_HELP)
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
    help="Per transaction: runs with at most this many effects between them, or "
    "run-less effects, or keys.",
)
@click.option(
    "--archive",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Append every deleted row to this JSON-lines file first (see above).",
)
@click.option(
    "--dry-run", is_flag=True, help="Count the first batch of each phase; delete nothing."
)
@json_option(GcReport)
@pass_cli
def gc(
    cli: CliContext, older_than: str, batch: int, archive: Path | None, dry_run: bool, as_json: bool
) -> None:
    from outbox.storage.admin.archive import ArchiveWriter
    from outbox.storage.admin.retention import collect_garbage, parse_horizon

    horizon = parse_horizon(older_than)
    engine = cli.outbox.engine
    writer = None if archive is None or dry_run else ArchiveWriter.open(archive)
    try:
        with console.status("collecting garbage…") as status:
            report = collect_garbage(
                engine,
                horizon,
                batch=batch,
                archive=writer,
                dry_run=dry_run,
                progress=lambda phase, n: status.update(f"{phase}: {n} more"),
            )
    finally:
        if writer is not None:
            writer.close()
    data = GcReport(
        older_than=older_than,
        dry_run=dry_run,
        deleted=report.deleted,
        batches=report.batches,
        archive=None if writer is None else str(archive),
        unreachable_shards=report.unreachable,
        values_left=report.values_left,
    )
    emit(
        data,
        as_json,
        lambda: table(
            f"gc (older than {older_than}){' dry run' if dry_run else ''}",
            ["table", "deleted"],
            list(report.deleted.items()),
        ),
    )
    if report.values_left and not as_json:
        console.print(
            "large values left: this login may not delete them (confined to a namespace); "
            "an unconfined operator's gc collects them"
        )
    if report.unreachable:
        shards = ", ".join(str(s) for s in sorted(report.unreachable))
        first = next(iter(report.unreachable.values()))
        raise click.ClickException(
            f"shards {shards} were left for the next gc: their node did not answer ({first}); "
            "the other shards were collected"
        )


@click.group("archive")
def archive_group() -> None:
    """Read what `outbox gc --archive` wrote."""


@archive_group.command("read")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--rows", is_flag=True, help="Print the rows (one JSON object a line), not a summary."
)
@click.option("--table", "only_table", default=None, help="Only rows of this table.")
@click.option(
    "--run",
    "run_id",
    type=click.UUID,
    default=None,
    help="Only the rows of this run (its steps, effects, attempts, signals, ledger).",
)
@json_option(ArchiveSummaryReport)
def archive_read(
    path: Path, rows: bool, only_table: str | None, run_id: UUID | None, as_json: bool
) -> None:
    """Summarise an archive (gc runs, rows per table), or print its rows."""
    from outbox.storage.admin.archive import read_archive, summarize_archive

    if rows or only_table or run_id:
        for entry in _filtered(read_archive(path), only_table, run_id):
            click.echo(entry.as_json())
        return
    summary = summarize_archive(path)
    data = ArchiveSummaryReport.model_validate(
        {
            "gc_runs": summary.headers,
            "rows": summary.rows,
            "torn_lines_skipped": summary.torn_lines,
        }
    )
    emit(
        data,
        as_json,
        lambda: table(
            f"{path}: {len(summary.headers)} gc run(s)"
            + (f", {summary.torn_lines} torn line(s) skipped" if summary.torn_lines else ""),
            ["table", "rows"],
            sorted(summary.rows.items()),
        ),
    )


def _filtered(entries: Iterable[Any], only_table: str | None, run_id: UUID | None) -> Iterator[Any]:
    effect_ids: set[UUID] = set()
    for entry in entries:
        if run_id is not None:
            row = entry.row
            if entry.table == "outbox_runs":
                mine = row.get("id") == run_id
            elif entry.table == "outbox_effect_attempts":
                mine = row.get("effect_id") in effect_ids
            else:
                mine = row.get("run_id") == run_id
                if mine and entry.table == "outbox_effects":
                    effect_ids.add(row["id"])
            if not mine:
                continue
        if only_table is None or entry.table == only_table:
            yield entry


COMMANDS = [migrate_command, db, gc, archive_group]
