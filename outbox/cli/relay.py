"""``outbox relay``: publish pending effects to Kafka for ``outbox deliver --from-kafka``."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from outbox.cli._common import CliContext, pass_cli, retried_at_startup
from outbox.cli.deliver import (
    checked_dsn,
    config_option,
    kafka_options_of,
    kind_option,
    load_deliverers,
    read_config,
    serve_until_signal,
    validated_settings,
)
from outbox.delivery.settings import RelaySettings

__all__ = ["COMMANDS"]


@click.command("relay")
@config_option
@kind_option
@click.option(
    "--kafka",
    envvar="OUTBOX_KAFKA_BOOTSTRAP",
    required=True,
    metavar="BOOTSTRAP",
    help="Kafka bootstrap servers.",
)
@click.option(
    "--topic-prefix",
    envvar="OUTBOX_KAFKA_TOPIC_PREFIX",
    default="outbox.",
    show_default=True,
    help="Effects of kind K go to topic PREFIX+K.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=RelaySettings.model_fields["batch_size"].default,
    show_default=True,
    help="Effects claimed and published per round.",
)
@click.option(
    "--dispatch-ttl",
    type=click.FloatRange(min=0.001, max=86_400),
    default=RelaySettings.model_fields["dispatch_ttl_seconds"].default,
    show_default=True,
    help="Seconds before an undelivered dispatch is dispatched again.",
)
@click.option(
    "--orphan-ttl",
    type=click.FloatRange(min=0, max=86_400),
    default=RelaySettings.model_fields["orphan_ttl_seconds"].default,
    show_default=True,
    help="Seconds what a dead relay dispatched waits for its deliverer before it is "
    "dispatched again (instead of the whole dispatch TTL).",
)
@click.option(
    "--kafka-option",
    "kafka_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="Extra kafka-python KafkaProducer setting, e.g. compression_type=gzip (repeatable).",
)
@click.option("--log-json", is_flag=True, help="Log JSON lines.")
@pass_cli
def relay(
    cli: CliContext,
    config_path: Path | None,
    kinds: tuple[str, ...],
    kafka: str,
    topic_prefix: str,
    batch_size: int,
    dispatch_ttl: float,
    orphan_ttl: float,
    kafka_options: tuple[str, ...],
    log_json: bool,
) -> None:
    """Stream mode: publish pending effects to Kafka for `outbox deliver --from-kafka`."""
    from outbox.cli.logs import configure
    from outbox.delivery.relay import Relay

    configure(logging.INFO, as_json=log_json)
    chosen = sorted(kinds) or sorted(load_deliverers(read_config(config_path), ()))
    dsn = retried_at_startup("checking the database", lambda: checked_dsn(cli))
    settings = validated_settings(
        RelaySettings,
        bootstrap_servers=kafka,
        topic_prefix=topic_prefix,
        batch_size=batch_size,
        dispatch_ttl_seconds=dispatch_ttl,
        orphan_ttl_seconds=orphan_ttl,
        producer=kafka_options_of(kafka_options),
    )
    serve_until_signal(
        dsn,
        lambda store: Relay(store, chosen, settings),
        f"relaying kinds {chosen} to {kafka} as {settings.owner}",
    )


COMMANDS = [relay]
