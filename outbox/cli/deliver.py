"""``outbox deliver`` (the daemon) and ``outbox reconcile`` (after an incident)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import click
import pydantic

from outbox.cli._common import (
    CliContext,
    console,
    emit,
    json_option,
    listening,
    pass_cli,
    retried_at_startup,
    table,
)
from outbox.cli.reports import ReconcileReport
from outbox.delivery import Deliverer
from outbox.delivery.config import DeliverersConfig
from outbox.delivery.settings import DeliverySettings, StreamSettings
from outbox.delivery.threads import DaemonThreads, default_workers
from outbox.errors import ConfigurationError
from outbox.storage.async_store import AsyncStore
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine, open_engine

__all__ = ["COMMANDS"]

F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound=pydantic.BaseModel)

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path, dir_okay=False),
    envvar="OUTBOX_DELIVERERS_CONFIG",
    default=None,
    help="Deliverers config (TOML); default: every installed deliverer with defaults.",
)
kind_option = click.option(
    "--kind", "kinds", multiple=True, help="Only these effect kinds (repeatable)."
)


def read_config(config_path: Path | None) -> DeliverersConfig:
    """The deliverers config file, read and validated once (without one: an empty config)."""
    from deliverers.registry import load_config

    return load_config(config_path) if config_path is not None else DeliverersConfig()


def load_deliverers(config: DeliverersConfig, kinds: tuple[str, ...]) -> dict[str, Deliverer]:
    """The registry from entry points and the config (no kinds: every installed type)."""
    from deliverers.registry import build_registry

    return build_registry(config, only=list(kinds) or None)


def checked_dsn(cli: CliContext) -> str:
    """The DSN of a database whose schema matches (migrating the embedded one)."""
    with cli.starting():
        engine = open_engine(cli.settings, application_name="outbox-cli")
    try:
        return libpq_dsn(engine.url)
    finally:
        engine.dispose()


def _default(name: str) -> Any:
    return DeliverySettings.model_fields[name].default


def setting_option(name: str, *flags: str, type: Any, help: str) -> Callable[[F], F]:
    """An option for a ``DeliverySettings`` field: its default shown, passed on only when set."""
    return click.option(
        *flags, name, type=type, default=None, help=f"{help}  [default: {_default(name)}]"
    )


_seconds = click.FloatRange(min=0.001, max=86_400)


@click.command("deliver")
@config_option
@kind_option
@setting_option(
    "concurrency", "--concurrency", type=click.IntRange(1, 10_000), help="Calls in flight at once."
)
@setting_option(
    "batch_size",
    "--batch-size",
    type=click.IntRange(1, 10_000),
    help="Effects claimed per statement (stream mode: records read per poll).",
)
@setting_option(
    "lease_seconds",
    "--lease",
    type=_seconds,
    help="Seconds an attempt is leased; heartbeats extend it.",
)
@setting_option(
    "poll_seconds",
    "--poll",
    type=_seconds,
    help="Longest wait between claims when idle (stream mode: the consumer's poll timeout).",
)
@setting_option(
    "grace_seconds",
    "--grace",
    type=click.FloatRange(min=0, max=86_400),
    help="On SIGTERM, how long in-flight calls may take to finish.",
)
@setting_option(
    "reconcile_seconds",
    "--reconcile-every",
    type=_seconds,
    help="How often expired attempts are reconciled.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65_535),
    default=None,
    help="Serve Prometheus /metrics at this port (on --metrics-host).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address /metrics listens on; 0.0.0.0 lets a scraper in another container reach it.",
)
@click.option("--log-json", is_flag=True, help="Log JSON lines.")
@click.option(
    "--dry-run",
    "dry_run",
    is_flag=True,
    help="Serve dry runs only: their effects get stubs ([dry_run] in the config); "
    "no sink is ever called.",
)
@click.option(
    "--check-config",
    is_flag=True,
    help="Validate the deliverers config (every table and key), say what it would "
    "serve, and exit without starting.",
)
@click.option(
    "--from-kafka",
    "kafka",
    envvar="OUTBOX_DELIVER_FROM_KAFKA",
    default=None,
    metavar="BOOTSTRAP",
    help="Stream mode: consume what `outbox relay` dispatched.",
)
@click.option(
    "--group",
    envvar="OUTBOX_KAFKA_GROUP",
    default=StreamSettings.model_fields["group"].default,
    show_default=True,
    help="Kafka consumer group (stream mode).",
)
@click.option(
    "--topic-prefix",
    envvar="OUTBOX_KAFKA_TOPIC_PREFIX",
    default=StreamSettings.model_fields["topic_prefix"].default,
    show_default=True,
    help="Effects of kind K are read from topic PREFIX+K (stream mode).",
)
@click.option(
    "--write-linger",
    type=float,
    envvar="OUTBOX_KAFKA_WRITE_LINGER",
    default=StreamSettings.model_fields["write_linger_seconds"].default,
    show_default=True,
    metavar="SECONDS",
    help="Stream mode: how long outcomes wait for the calls still under way, to be "
    "written together (0: at once).",
)
@click.option(
    "--kafka-option",
    "kafka_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra kafka-python KafkaConsumer setting, e.g. session_timeout_ms=6000 "
    "(repeatable; the group's timeouts decide how fast it settles: see "
    "docs/howto/stream-mode.md).",
)
@pass_cli
def deliver(
    cli: CliContext,
    /,
    config_path: Path | None,
    kinds: tuple[str, ...],
    metrics_port: int | None,
    metrics_host: str,
    log_json: bool,
    dry_run: bool,
    check_config: bool,
    kafka: str | None,
    group: str,
    topic_prefix: str,
    write_linger: float,
    kafka_options: tuple[str, ...],
    **chosen: Any,
) -> None:
    """Deliver pending effects until SIGTERM/SIGINT (then finish in-flight calls and exit 0).

    Poll mode claims from PostgreSQL; with --from-kafka the same daemon reads
    what `outbox relay` published. Every option acts in both modes. The
    config's approval gates ([[approvals]]) are stored at start-up, so every
    intent written from then on is checked against them.
    """
    from outbox.cli.logs import configure
    from outbox.delivery.daemon import DeliveryDaemon
    from outbox.delivery.dry_run import dry_run_registry
    from outbox.delivery.metrics import DeliveryMetrics

    configure(logging.INFO, as_json=log_json)
    given = {name: value for name, value in chosen.items() if value is not None}
    if kafka is None and kafka_options:
        raise click.UsageError("--kafka-option needs --from-kafka")
    if dry_run and kafka is not None:
        raise click.UsageError("--dry-run serves dry runs from PostgreSQL: drop --from-kafka")
    config = read_config(config_path)
    deliverers = load_deliverers(config, kinds)
    if check_config:
        _report_config(config_path, config, deliverers)
        return
    dsn = retried_at_startup("checking the database", lambda: checked_dsn(cli))
    if config.approvals:
        retried_at_startup(
            "storing the approval gates", lambda: cli.outbox.apply_gates(config.approvals)
        )
    metrics = DeliveryMetrics()
    settings: DeliverySettings
    if kafka is not None:
        settings = validated_settings(
            StreamSettings,
            bootstrap_servers=kafka,
            group=group,
            topic_prefix=topic_prefix,
            write_linger_seconds=write_linger,
            consumer=kafka_options_of(kafka_options),
            **given,
        )
    else:
        settings = validated_settings(DeliverySettings, **given)
    if metrics_port is not None:
        with listening(metrics_host, metrics_port, hint="'--metrics-port'"):
            metrics.serve(metrics_port, metrics_host)

    if isinstance(settings, StreamSettings) and (
        rated := sorted(k for k, d in deliverers.items() if d.rate is not None)
    ):
        # its claims take what the relay published: no rate is charged on the way
        raise ConfigurationError(
            f"kind {rated[0]!r} declares a rate: stream mode does not enforce declared "
            "rates yet; deliver that kind by polling (docs/howto/stream-mode.md)"
        )
    serving = deliverers
    if dry_run:
        # Only the recording deliverer: these processes never reach a sink.
        serving = dry_run_registry(deliverers, config.dry_run, None)

    def make(store: AsyncStore) -> DeliveryDaemon:
        source = None
        if isinstance(settings, StreamSettings):
            from outbox.delivery.stream import KafkaSource

            source = KafkaSource(store, sorted(deliverers), settings)
        chosen = deliverers
        if dry_run:
            chosen = dry_run_registry(deliverers, config.dry_run, store.recorded_result)
        return DeliveryDaemon(store, chosen, settings, source=source, metrics=metrics)

    mode = f"from Kafka {kafka} (group {group})" if kafka else "from PostgreSQL"
    serve_until_signal(dsn, make, f"delivering kinds {sorted(serving)} {mode} as {settings.owner}")


def _report_config(
    path: Path | None, config: DeliverersConfig, deliverers: dict[str, Deliverer]
) -> None:
    """``--check-config``: what the config says, in a few lines (it was valid)."""
    where = str(path) if path is not None else "no config file (every installed deliverer)"
    console.print(f"config ok: {where}")
    table(
        "kinds delivered",
        ["kind", "type", "idempotent", "max attempts"],
        [
            (kind, type(d).__name__, d.idempotent, d.max_attempts)
            for kind, d in sorted(deliverers.items())
        ],
    )
    names = ", ".join(g.name for g in config.approvals) or "none"
    console.print(f"{len(config.approvals)} approval gate(s): {names}")
    for deliverer in deliverers.values():
        deliverer.close()


def validated_settings(model: type[S], **values: Any) -> S:
    """Settings from command-line values; a bad value is one clear line naming the option."""
    try:
        return model(**values)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise click.BadParameter(
            f"{first.get('input')!r}: {first['msg']}", param_hint=field
        ) from None


class _Daemon(Protocol):
    def stop(self) -> None: ...

    async def run(self) -> None: ...


def serve_until_signal(dsn: str, make: Callable[[AsyncStore], _Daemon], banner: str) -> None:
    """Run an async daemon until SIGTERM/SIGINT asks it to stop gracefully."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # Blocking calls (a synchronous deliverer, a lookup) run on daemon threads:
        # one the daemon abandons at the end of --grace must not hold the process
        # until it returns, as asyncio.run and the interpreter would wait for it.
        loop.set_default_executor(DaemonThreads(default_workers(), "outbox-call"))
        store = AsyncStore(make_async_engine(dsn, pool_size=4))
        daemon = make(store)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.stop)
        logging.getLogger("outbox.cli").info(banner)
        try:
            await daemon.run()
        finally:
            await store.dispose()

    asyncio.run(main())


def kafka_options_of(options: tuple[str, ...]) -> dict[str, Any]:
    """``--kafka-option KEY=VALUE`` settings as a dict, each value of the type of KEY's default.

    A number or a boolean where kafka-python's default for KEY is one (and the
    text reads as one), else the text: ``client_id=007`` and a password of
    ``true`` stay text.
    """
    defaults = _kafka_defaults()
    parsed: dict[str, Any] = {}
    for option in options:
        key, sep, raw = option.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{option!r}: expected KEY=VALUE", param_hint="--kafka-option")
        parsed[key] = _kafka_value(raw, defaults.get(key), numeric=key.endswith("_bytes"))
    return parsed


def _kafka_defaults() -> dict[str, Any]:
    try:
        from kafka import KafkaConsumer, KafkaProducer
    except ImportError:  # the command says the extra is missing
        return {}
    return {**KafkaConsumer.DEFAULT_CONFIG, **KafkaProducer.DEFAULT_CONFIG}


def _kafka_value(raw: str, default: Any, *, numeric: bool) -> Any:
    """``raw`` as the type of ``default`` when it reads as one (``acks=all`` stays text)."""
    if isinstance(default, bool):
        return {"true": True, "false": False}.get(raw.lower(), raw)
    if isinstance(default, int | float) or (default is None and numeric):
        for number in (int, float):
            try:
                return number(raw)
            except ValueError:
                continue
    return raw


@click.command("reconcile")
@config_option
@kind_option
@click.option("--dry-run", is_flag=True, help="Report what would be done; change nothing.")
@click.option(
    "--max-rows",
    type=click.IntRange(1, 1_000_000),
    default=10_000,
    show_default=True,
    help="Resolve (and list as unknown) at most this many effects.",
)
@json_option(ReconcileReport)
@pass_cli
def reconcile_command(
    cli: CliContext,
    config_path: Path | None,
    kinds: tuple[str, ...],
    dry_run: bool,
    max_rows: int,
    as_json: bool,
) -> None:
    """Resolve effects whose attempt started but never recorded an end; list the unknown ones."""
    from outbox.delivery.reconcile import reconcile

    deliverers = load_deliverers(read_config(config_path), kinds)
    dsn = checked_dsn(cli)

    async def main() -> Any:
        store = AsyncStore(make_async_engine(dsn, pool_size=2))
        try:
            return await reconcile(
                store, deliverers, worker="outbox-reconcile", dry_run=dry_run, max_rows=max_rows
            )
        finally:
            for deliverer in deliverers.values():
                await deliverer.aclose()
            await store.dispose()

    with console.status("reconciling…"):
        report = asyncio.run(main())
    unknown = cli.outbox.effects(status="unknown", limit=max_rows)
    gone = [
        {"owner": owner, "in_flight": n, "dispatched": d, "lease_ends": ends}
        for owner, n, d, ends in cli.outbox.store.deliverers.gone_in_flight()
    ]
    data = ReconcileReport.model_validate(
        {
            **report.as_dict(),
            "held_by_gone_deliverers": gone,
            "unknown": [
                {
                    "id": e.id,
                    "kind": e.kind,
                    "run_id": e.run_id,
                    "attempt": e.attempt,
                    "key": e.idempotency_key,
                    "last_error": e.last_error,
                }
                for e in unknown
            ],
        }
    )

    def render() -> None:
        title = "reconcile (dry run)" if dry_run else "reconcile"
        table(
            f"{title}: {sum(report.counts.values())} expired attempt(s)",
            ["action", "count"],
            sorted(report.counts.items()),
        )
        if gone:
            table(
                f"held by {len(gone)} deliverer(s) or relay(s) that are gone (killed or "
                "crashed): reconciled when their leases end; a running `outbox deliver` puts "
                "the idempotent ones back within seconds, a running `outbox relay` cuts a dead "
                "relay's dispatches to its orphan TTL",
                ["owner", "attempts", "dispatched", "leases end"],
                [(g["owner"], g["in_flight"], g["dispatched"], g["lease_ends"]) for g in gone],
            )
        if report.items:
            table(
                "expired attempts",
                ["effect", "kind", "attempt", "action", "note"],
                [(i.effect_id, i.kind, i.attempt, i.action, i.note) for i in report.items],
            )
        table(
            f"unknown: {len(unknown)} effect(s) wait for an operator "
            "(outbox effects resolve ID --as succeeded|retry|failed --note TEXT)",
            ["effect", "kind", "run", "attempt", "key", "why"],
            [
                (e.id, e.kind, e.run_id, e.attempt, e.idempotency_key[:16], e.last_error)
                for e in unknown
            ],
        )

    emit(data, as_json, render)


COMMANDS = [deliver, reconcile_command]
