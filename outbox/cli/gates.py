"""``outbox gates apply|list|remove``: the approval gates PostgreSQL applies to every intent."""

from __future__ import annotations

from pathlib import Path

import click

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.cli.reports import GateListReport, GatesApplyReport, GatesRemoveReport
from outbox.governance.gates import Gate

__all__ = ["COMMANDS"]


def _rows(gates: list[Gate]) -> list[tuple[object, ...]]:
    return [
        (
            g.name,
            g.kind,
            " and ".join(f"{c.pointer} {c.op} {c.value!r}" for c in g.when) or "(every intent)",
            g.timeout,
            g.on_timeout.value,
            g.escalate_to,
        )
        for g in gates
    ]


_COLUMNS = ["gate", "kind", "when", "timeout s", "on timeout", "escalate to"]


@click.group("gates")
def gates() -> None:
    """Approval gates: which intents wait for a person's approval."""


@gates.command("apply")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="OUTBOX_DELIVERERS_CONFIG",
    required=True,
    help="Deliverers config (TOML) with [[approvals]] tables.",
)
@click.option("--prune", is_flag=True, help="Also remove gates the file does not declare.")
@json_option(GatesApplyReport)
@pass_cli
def gates_apply(cli: CliContext, config_path: Path, prune: bool, as_json: bool) -> None:
    """Store the gates of a config file (replacing gates of the same name)."""
    from deliverers.registry import load_config

    # The whole file is validated, kinds included: a typo anywhere refuses it.
    stored = cli.outbox.apply_gates(load_config(config_path).approvals, prune=prune)
    emit(
        GatesApplyReport(applied=stored, pruned=prune),
        as_json,
        lambda: console.print(f"{len(stored)} gate(s) applied: {', '.join(stored) or '-'}"),
    )


@gates.command("list")
@json_option(GateListReport)
@pass_cli
def gates_list(cli: CliContext, as_json: bool) -> None:
    """The gates in force."""
    found = cli.outbox.gates()
    emit(
        GateListReport(found),
        as_json,
        lambda: table(f"gates ({len(found)})", _COLUMNS, _rows(found)),
    )


@gates.command("remove")
@click.argument("names", nargs=-1, required=True)
@json_option(GatesRemoveReport)
@pass_cli
def gates_remove(cli: CliContext, names: tuple[str, ...], as_json: bool) -> None:
    """Remove gates by name."""
    removed = cli.outbox.remove_gates(list(names))
    emit(
        GatesRemoveReport(removed=removed),
        as_json,
        lambda: console.print(f"{len(removed)} gate(s) removed: {', '.join(removed) or '-'}"),
    )


COMMANDS = [gates]
