"""``outbox worker`` (runs an agent), ``outbox signal`` and ``outbox serve`` (signals over HTTP)."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import click

from outbox.cli._common import CliContext, console, emit, json_option, listening, pass_cli
from outbox.errors import ConfigurationError
from outbox.validation import import_callable

__all__ = ["COMMANDS"]


@click.command("worker")
@click.argument("handler_path", metavar="MODULE:FUNCTION")
@click.option("--agent", required=True, help="Agent name of the runs to execute.")
@click.option("--version", "version", required=True, help="Agent version this code is.")
@click.option("--concurrency", type=click.IntRange(1, 1000), default=4, show_default=True)
@click.option(
    "--lease",
    "lease_seconds",
    type=click.FloatRange(min=0.001, max=86_400),
    default=30.0,
    show_default=True,
    help="Seconds a run is leased; heartbeats extend it.",
)
@click.option(
    "--setup",
    "setup_path",
    default=None,
    metavar="MODULE:FUNCTION",
    help="Called with the Outbox first (e.g. to register version migrations).",
)
@click.option("--log-json", is_flag=True)
@pass_cli
def worker(
    cli: CliContext,
    handler_path: str,
    agent: str,
    version: str,
    concurrency: int,
    lease_seconds: float,
    setup_path: str | None,
    log_json: bool,
) -> None:
    """Execute runs of one agent version until SIGTERM/SIGINT.

    An ``async def`` handler gets an AsyncRun, and --concurrency runs work at
    once on one event loop.
    """
    from outbox.cli.logs import configure

    configure(logging.INFO, as_json=log_json)
    handler = import_callable(handler_path, field="handler")
    ob = cli.outbox
    if setup_path is not None:
        import_callable(setup_path, field="setup")(ob)
    runner = ob.worker(
        agent, version, handler, concurrency=concurrency, lease_seconds=lease_seconds
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.stop())
    runner.run()


@click.command("signal")
@click.argument("run_id")
@click.argument("name")
@click.option("--data", default="null", help="The payload, as JSON.")
@click.option("--dedup-key", default=None, help="Sending the same key again is a no-op.")
@json_option
@pass_cli
def signal_command(
    cli: CliContext, run_id: str, name: str, data: str, dedup_key: str | None, as_json: bool
) -> None:
    """Send a signal (an approval, a webhook's news) to a run."""
    try:
        payload = json.loads(data)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--data") from None
    except RecursionError:
        raise click.BadParameter("nested too deeply", param_hint="--data") from None
    receipt = cli.outbox.signal(run_id, name, payload, dedup_key=dedup_key)
    data_out = {
        "signal_id": None if receipt.signal_id is None else str(receipt.signal_id),
        "duplicate": receipt.duplicate,
        "woke_run": receipt.woke_run,
    }
    emit(
        data_out,
        as_json,
        lambda: console.print(
            "duplicate: already received"
            if receipt.duplicate
            else f"signal {receipt.signal_id} stored"
            + ("; the run was woken" if receipt.woke_run else "")
        ),
    )


def _secret(secret_file: Path | None) -> bytes:
    if secret_file is not None:
        return secret_file.read_bytes().strip()
    value = os.environ.get("OUTBOX_WEBHOOK_SECRET")
    if not value:
        raise ConfigurationError(
            "OUTBOX_WEBHOOK_SECRET is not set (or pass --secret-file): signals are never unsigned"
        )
    return value.encode()


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65_535), default=8080, show_default=True)
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False, readable=True),
    default=None,
)
@click.option(
    "--tolerance",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds a signed request stays valid.",
)
@pass_cli
def serve(
    cli: CliContext, host: str, port: int, secret_file: Path | None, tolerance: float
) -> None:
    """Accept signed signals over HTTP; expose /healthz and /metrics."""
    from outbox.cli.logs import configure
    from outbox.serve.webhooks import SignalServer

    configure(logging.INFO)
    secret = _secret(secret_file)
    ob = cli.outbox
    with listening(host, port):
        server = SignalServer(ob, secret, host=host, port=port, tolerance=tolerance)

    def stop(*_: Any) -> None:
        import threading

        threading.Thread(target=server.shutdown, daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    logging.getLogger("outbox.serve.webhooks").info("serving on http://%s:%d", host, server.port)
    server.serve_forever()


COMMANDS = [worker, signal_command, serve]


@click.command("sink")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65_535), default=8080, show_default=True)
def sink(host: str, port: int) -> None:
    """A sample HTTP sink that honours Idempotency-Key (GET /stats shows what it applied)."""
    import threading

    from deliverers.testing import IdempotentHttpSink

    with listening(host, port):
        server = IdempotentHttpSink(host=host, port=port).start()
    console.print(f"sink listening on {server.url} (GET /stats)")
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    server.stop()


COMMANDS.append(sink)
