"""``outbox effects list|show``: intents and their delivery state."""

from __future__ import annotations

import click

from outbox.cli._common import (
    CliContext,
    console,
    emit,
    json_option,
    page_options,
    page_title,
    pass_cli,
    run_suffix,
    table,
)
from outbox.cli.reports import EffectDetailReport, EffectListReport
from outbox.models import Effect, EffectStatus
from outbox.validation import as_uuid

__all__ = ["COMMANDS"]


@click.group("effects")
def effects() -> None:
    """Inspect effects and act on them."""


@effects.command("list")
@click.option("--run", "run_id", default=None, help="Only effects of this run.")
@click.option(
    "--status",
    type=click.Choice([s.value for s in EffectStatus]),
    default=None,
    help="Only effects in this state.",
)
@click.option("--kind", default=None, help="Only effects of this kind.")
@page_options(most=1_000_000, default=100, noun="effects", since="intended before")
@click.option(
    "--oldest-first", is_flag=True, help="Intent order instead (--before then means after)."
)
@json_option(EffectListReport)
@pass_cli
def effects_list(
    cli: CliContext,
    run_id: str | None,
    status: str | None,
    kind: str | None,
    limit: int,
    before: str | None,
    oldest_first: bool,
    as_json: bool,
) -> None:
    """List effects, newest first, a page at a time (--limit, --before)."""
    from outbox.client_core import effect_filters

    filters = effect_filters(run_id=run_id, status=status, kind=kind, limit=limit)
    if before is not None:
        filters["before"] = as_uuid(before, "before")
    found = cli.outbox.store.list_effects(**filters, newest_first=not oldest_first)
    emit(
        EffectListReport(found),
        as_json,
        lambda: table(
            page_title(
                "effects",
                found,
                limit,
                "outbox effects list" + (" --oldest-first" if oldest_first else ""),
                "intent order" if oldest_first else "newest first",
            ),
            # What matters most first: a narrow terminal leaves out columns from the right.
            ["id", "status", "kind", "attempt", "step", "run", "key", "last error"],
            [
                (
                    e.id,
                    e.status.value,
                    e.kind,
                    e.attempt,
                    e.step_id,
                    run_suffix(e.run_id),
                    e.idempotency_key[:16],
                    e.last_error,
                )
                for e in found
            ],
        ),
    )


@effects.command("show")
@click.argument("effect_id")
@json_option(EffectDetailReport)
@pass_cli
def effects_show(cli: CliContext, effect_id: str, as_json: bool) -> None:
    """Show one effect with its payload, result and attempt log."""
    effect = cli.outbox.effect(effect_id)
    attempts = cli.outbox.store.attempts(effect.id)

    def render() -> None:
        table(
            f"effect {effect.id}",
            ["field", "value"],
            [(k, v) for k, v in effect.model_dump().items()],
        )
        # In full: an approval names it (`outbox effects approve ID --digest ...`).
        console.print(f"digest: {effect.digest}")
        table(
            "attempts",
            ["attempt", "worker", "started", "finished", "outcome", "detail"],
            [
                (a.attempt, a.worker, a.started_at, a.finished_at, a.outcome, a.detail)
                for a in attempts
            ],
        )

    emit(EffectDetailReport(effect=effect, attempts=attempts), as_json, render)


def _operator() -> str:
    import getpass

    return getpass.getuser()


@effects.command("resolve")
@click.argument("effect_id")
@click.option(
    "--as",
    "outcome",
    type=click.Choice(["succeeded", "retry", "failed"]),
    required=True,
    help="What the outside world says happened.",
)
@click.option("--note", required=True, help="Why (kept in the attempt log).")
@click.option("--by", "operator", default=None, help="Who resolves it (default: your user).")
@json_option(Effect)
@pass_cli
def effects_resolve(
    cli: CliContext, effect_id: str, outcome: str, note: str, operator: str | None, as_json: bool
) -> None:
    """Close an unknown effect after checking the sink by hand."""
    effect = cli.outbox.resolve_effect(
        effect_id, outcome=outcome, note=note, operator=operator or _operator()
    )
    emit(
        effect,
        as_json,
        lambda: table(
            "resolved",
            ["effect", "status", "key"],
            [(effect.id, effect.status.value, effect.idempotency_key)],
        ),
    )


@effects.command("retry")
@click.argument("effect_id")
@click.option(
    "--attempts",
    "extra_attempts",
    type=click.IntRange(1, 1000),
    default=3,
    show_default=True,
    help="How many more attempts it gets.",
)
@click.option("--note", default=None, help="Why (kept in the attempt log).")
@json_option(Effect)
@pass_cli
def effects_retry(
    cli: CliContext, effect_id: str, extra_attempts: int, note: str | None, as_json: bool
) -> None:
    """Put a failed effect back to pending, with the same idempotency key."""
    effect = cli.outbox.retry_effect(
        effect_id, operator=_operator(), extra_attempts=extra_attempts, note=note
    )
    emit(
        effect,
        as_json,
        lambda: table(
            "retrying",
            ["effect", "status", "max attempts"],
            [(effect.id, effect.status.value, effect.max_attempts)],
        ),
    )


@effects.command("approve")
@click.argument("effect_id")
@click.option(
    "--digest",
    required=True,
    help="sha256 of the payload you approve (`outbox effects show ID`); "
    "no other payload is released.",
)
@click.option("--note", required=True, help="Why (kept in the attempt log).")
@click.option("--by", "operator", default=None, help="Who approves (default: your user).")
@json_option(Effect)
@pass_cli
def effects_approve(
    cli: CliContext, effect_id: str, digest: str, note: str, operator: str | None, as_json: bool
) -> None:
    """Release an effect held for approval (once; only the payload with this digest)."""
    effect = cli.outbox.approve_effect(
        effect_id, digest=digest, note=note, by=operator or _operator(), via="cli"
    )
    emit(
        effect,
        as_json,
        lambda: console.print(f"approved: effect {effect.id} is {effect.status.value}"),
    )


@effects.command("reject")
@click.argument("effect_id")
@click.option("--note", required=True, help="Why (kept in the attempt log; the agent sees it).")
@click.option("--digest", default=None, help="Only if the payload has this digest.")
@click.option("--by", "operator", default=None, help="Who rejects (default: your user).")
@json_option(Effect)
@pass_cli
def effects_reject(
    cli: CliContext,
    effect_id: str,
    note: str,
    digest: str | None,
    operator: str | None,
    as_json: bool,
) -> None:
    """End an effect held for approval as rejected: it never reaches the sink."""
    effect = cli.outbox.reject_effect(
        effect_id, note=note, digest=digest, by=operator or _operator(), via="cli"
    )
    emit(
        effect,
        as_json,
        lambda: table("rejected", ["effect", "status"], [(effect.id, effect.status.value)]),
    )


COMMANDS = [effects]
