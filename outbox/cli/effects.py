"""``outbox effects list|show``: intents and their delivery state."""

from __future__ import annotations

import click

from outbox.cli._common import CliContext, emit, json_option, pass_cli, table
from outbox.models import EffectStatus

__all__ = ["COMMANDS"]


@click.group("effects")
def effects() -> None:
    """Inspect effects and act on them."""


@effects.command("list")
@click.option("--run", "run_id", default=None, help="Only effects of this run.")
@click.option("--status", type=click.Choice([s.value for s in EffectStatus]), default=None)
@click.option("--kind", default=None)
@click.option("--limit", type=click.IntRange(1, 1_000_000), default=100, show_default=True)
@json_option
@pass_cli
def effects_list(
    cli: CliContext,
    run_id: str | None,
    status: str | None,
    kind: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List effects in intent order."""
    found = cli.outbox.effects(run_id=run_id, status=status, kind=kind, limit=limit)
    emit(
        found,
        as_json,
        lambda: table(
            f"effects ({len(found)})",
            ["id", "run", "step", "kind", "status", "attempt", "key", "last error"],
            [
                (
                    e.id,
                    str(e.run_id or "")[:8],
                    e.step_id,
                    e.kind,
                    e.status.value,
                    e.attempt,
                    e.idempotency_key[:16],
                    e.last_error,
                )
                for e in found
            ],
        ),
    )


@effects.command("show")
@click.argument("effect_id")
@json_option
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
        table(
            "attempts",
            ["attempt", "worker", "started", "finished", "outcome", "detail"],
            [
                (a.attempt, a.worker, a.started_at, a.finished_at, a.outcome, a.detail)
                for a in attempts
            ],
        )

    emit({"effect": effect, "attempts": attempts}, as_json, render)


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
@json_option
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
@json_option
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


COMMANDS = [effects]
