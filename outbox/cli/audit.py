"""``outbox audit verify|export|keygen``: the tamper-evident record of runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.cli.reports import AuditVerifyReport

__all__ = ["COMMANDS", "OUTSIDE_RUNS"]

#: Where ``broken`` lists the breaks of effects written outside any run (never a run id).
OUTSIDE_RUNS = "(no run)"


@click.group("audit")
def audit() -> None:
    """Hash chains over steps and attempt logs; signed run records."""


@audit.command("verify")
@click.argument("run_id", required=False)
@click.option(
    "--limit",
    type=click.IntRange(1, 10_000_000),
    default=100_000,
    show_default=True,
    help="Without RUN: check this many runs, and this many effects outside runs, newest first.",
)
@json_option(AuditVerifyReport)
@pass_cli
def audit_verify(cli: CliContext, run_id: str | None, limit: int, as_json: bool) -> None:
    """Recompute the hash chains of one run (or of every run) and report the first break.

    Every value the runs store by reference is hashed too (an altered blob is a break).

    Without RUN, the effects written outside any run (``Outbox.transaction``)
    are checked too; their breaks are listed under ``(no run)``. Exit 0 when
    every chain holds, 1 when one does not (the break names the run, the step
    or the effect and its attempt-log row).
    """
    from outbox.governance.audit_record import effect_records
    from outbox.governance.chain import stored_values, value_breaks, verify_effect
    from outbox.storage.audit_reads import effects_outside_runs

    ob = cli.outbox
    run_ids = [run_id] if run_id is not None else [str(r) for r in ob.audited_runs(limit)]
    broken: dict[str, list[str]] = {}
    outside: list[str] = []
    effects_checked = 0
    with Progress(
        TextColumn("verifying {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=True,
        disable=as_json or run_id is not None,
    ) as progress:
        task = progress.add_task("runs", total=len(run_ids))
        for rid in run_ids:
            found = ob.verify_run(rid)
            if found:
                broken[str(rid)] = [str(b) for b in found]
            progress.advance(task)
        if run_id is None:
            task = progress.add_task("effects outside runs", total=None)
            for effect_rows, attempt_rows, blob_rows in effects_outside_runs(ob.engine, limit):
                for effect in effect_records(effect_rows, attempt_rows):
                    outside.extend(str(b) for b in verify_effect(effect))
                places = stored_values({"effects": effect_rows})
                outside.extend(str(b) for b in value_breaks(places, blob_rows))
                effects_checked += len(effect_rows)
                progress.advance(task, len(effect_rows))
    if outside:
        broken[OUTSIDE_RUNS] = outside
    report = AuditVerifyReport(runs_checked=len(run_ids), intact=not broken, broken=broken)

    def render() -> None:
        if not broken:
            also = "" if run_id is not None else f" and {effects_checked} effect(s) outside runs"
            console.print(f"intact: {len(run_ids)} run(s){also}, every chain holds")
            return
        runs_broken = len(broken) - (1 if outside else 0)
        also = f"; {len(outside)} break(s) in effects outside runs" if outside else ""
        table(
            f"broken: {runs_broken} of {len(run_ids)} run(s){also}",
            ["run", "first break"],
            [(rid, found[0]) for rid, found in broken.items()],
        )

    emit(report, as_json, render)
    if broken:
        sys.exit(1)


@audit.command("export")
@click.argument("run_id")
@click.option(
    "--key",
    "key_path",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    envvar="OUTBOX_AUDIT_KEY",
    required=True,
    help="Ed25519 private key (PEM) that signs the record (outbox audit keygen).",
)
@click.option(
    "--out",
    "out_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Write here (default: standard output).",
)
@pass_cli
def audit_export(cli: CliContext, run_id: str, key_path: Path, out_path: Path | None) -> None:
    """Write a signed, self-contained JSON record of a run (docs/reference/audit.md verifies it)."""
    from outbox.governance.chain_signing import sign_record

    record, breaks = cli.outbox.checked_record(run_id)
    if breaks:
        raise click.ClickException(f"run {run_id} does not verify, not exported: {breaks[0]}")
    signed = sign_record(record, key_path.read_bytes())
    text = json.dumps(signed, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if out_path is None:
        click.echo(text, nl=False)
    else:
        out_path.write_text(text)
        click.echo(f"wrote {out_path} (signed by {signed['signature']['public_key']})", err=True)


@audit.command("keygen")
@click.option(
    "--out",
    "out_path",
    type=click.Path(path_type=Path, dir_okay=False),
    required=True,
    help="Where the private key goes (PEM, mode 0600); the public key is printed.",
)
def audit_keygen(out_path: Path) -> None:
    """Make an Ed25519 signing key for `outbox audit export`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from outbox.governance.chain_signing import public_key_of

    if out_path.exists():
        raise click.BadParameter(f"{out_path} exists: not overwritten", param_hint="'--out'")
    pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    click.echo(public_key_of(pem))


COMMANDS = [audit]
