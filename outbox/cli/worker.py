"""The long-running commands, and the signal a person sends to a run.

``outbox worker`` (runs an agent), ``outbox serve`` (the console and HTTP API),
``outbox signal`` (to a run), ``outbox sink`` (a sample HTTP sink for the quickstart).
"""

from __future__ import annotations

import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from outbox.cli._common import (
    CliContext,
    can_listen,
    console,
    emit,
    json_option,
    listening,
    pass_cli,
    retried_at_startup,
)
from outbox.errors import ConfigurationError
from outbox.runs.signals import SignalReceipt
from outbox.validation import import_callable

__all__ = ["COMMANDS"]

F = TypeVar("F", bound=Callable[..., Any])


def _worker_default(name: str) -> Any:
    from outbox.runs.worker import WorkerSettings

    return WorkerSettings.model_fields[name].default


def worker_option(name: str, *flags: str, type: Any, help: str) -> Callable[[F], F]:
    """An option for a ``WorkerSettings`` field: its default shown, passed on only when set."""
    return click.option(
        *flags, name, type=type, default=None, help=f"{help}  [default: {_worker_default(name)}]"
    )


@click.command("worker")
@click.argument("handler_path", metavar="MODULE:FUNCTION")
@click.option("--agent", required=True, help="Agent name of the runs to execute.")
@click.option("--version", "version", required=True, help="Agent version this code is.")
@worker_option(
    "concurrency",
    "--concurrency",
    type=click.IntRange(1, 1000),
    help="Runs worked on at once (waiting runs do not count).",
)
@worker_option(
    "lease_seconds",
    "--lease",
    type=click.FloatRange(min=0.001, max=86_400),
    help="Seconds a run is leased; heartbeats extend it.",
)
@worker_option(
    "grace_seconds",
    "--grace",
    type=click.FloatRange(min=0, max=86_400),
    help="On SIGTERM, how long running handlers may take to finish.",
)
@click.option(
    "--setup",
    "setup_path",
    default=None,
    metavar="MODULE:FUNCTION",
    help="Called with the Outbox first (e.g. to register version upgrades).",
)
@click.option("--log-json", is_flag=True, help="Log JSON lines.")
@pass_cli
def worker(
    cli: CliContext,
    /,
    handler_path: str,
    agent: str,
    version: str,
    setup_path: str | None,
    log_json: bool,
    **chosen: Any,
) -> None:
    """Execute runs of one agent version until SIGTERM/SIGINT.

    An ``async def`` handler gets an AsyncRun, and --concurrency runs work at
    once on one event loop. On SIGTERM no run is claimed any more; handlers
    still running after --grace keep their lease until it runs out, then their
    runs resume elsewhere from the last recorded step.
    """
    from outbox.cli.logs import configure

    configure(logging.INFO, as_json=log_json)
    given = {name: value for name, value in chosen.items() if value is not None}
    handler = import_callable(handler_path, field="handler")
    ob = retried_at_startup("connecting", lambda: cli.outbox)
    if setup_path is not None:
        import_callable(setup_path, field="setup")(ob)
    runner = ob.worker(agent, version, handler, **given)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.stop())
    runner.run()


@click.command("signal")
@click.argument("run_id")
@click.argument("name")
@click.option("--data", default="null", help="The payload, as JSON.")
@click.option("--dedup-key", default=None, help="Sending the same key again is a no-op.")
@json_option(SignalReceipt)
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
    emit(
        receipt,
        as_json,
        lambda: console.print(
            "duplicate: already received"
            if receipt.duplicate
            else f"signal {receipt.signal_id} stored"
            + ("; the run was woken" if receipt.woke_run else "")
        ),
    )


def _settings(**values: Any) -> Any:
    from pydantic import ValidationError as PydanticError

    from outbox.serve.settings import ServeSettings

    try:
        return ServeSettings(**values)
    except PydanticError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0])
        option = "--allowed-host" if field == "allowed_hosts" else "--" + field.replace("_", "-")
        raise click.BadParameter(
            f"{first.get('input')!r}: {first['msg']}", param_hint=option
        ) from None


def _host_list(given: tuple[str, ...]) -> tuple[str, ...] | None:
    """``--allowed-host`` values (the variable holds them space- or comma-separated)."""
    names = tuple(n for value in given for n in value.replace(",", " ").split())
    return names or None


@click.command("serve")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on (keep it local)."
)
@click.option(
    "--allowed-host",
    "allowed_host",
    multiple=True,
    envvar="OUTBOX_ALLOWED_HOSTS",
    help="A host name the server answers to (repeat it; .example.com allows subdomains); "
    "other Host headers are answered 421. Default: the --host address and localhost.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65_535),
    default=8080,
    show_default=True,
    help="Port to listen on.",
)
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False, readable=True),
    default=None,
    help="The webhook signing secret (else OUTBOX_WEBHOOK_SECRET[_FILE]).",
)
@click.option(
    "--operator-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Who holds this token may act in the console (else OUTBOX_OPERATOR_TOKEN[_FILE]).",
)
@click.option(
    "--metrics-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Bearer token of /metrics (else OUTBOX_METRICS_TOKEN[_FILE]).",
)
@click.option(
    "--api-token-file",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Bearer token of the HTTP API, /api/v1 (else OUTBOX_API_TOKEN[_FILE]); "
    "without one the API is off.",
)
@click.option(
    "--tolerance",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds a signed request stays valid.",
)
@click.option(
    "--max-concurrency",
    type=int,
    default=100,
    show_default=True,
    help="Requests in progress at once; more are answered 503 (/healthz never is).",
)
@click.option(
    "--max-connections-per-client",
    type=int,
    default=32,
    show_default=True,
    help="Open connections from one client address; more are closed at once "
    "(behind a proxy, the proxy is one client).",
)
@click.option(
    "--max-connections",
    type=int,
    default=1000,
    show_default=True,
    help="Open connections in all; past it the oldest one waiting for a request is closed.",
)
@click.option(
    "--header-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds a client has to send a request's headers.",
)
@click.option(
    "--body-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds a client has to send a request's body (else 408).",
)
@click.option(
    "--idle-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds an idle keep-alive connection is kept open.",
)
@click.option(
    "--max-body-bytes",
    type=int,
    default=1024 * 1024,
    show_default=True,
    help="Largest request body read (more is answered 413, unread).",
)
@click.option(
    "--max-wait",
    type=float,
    default=60.0,
    show_default=True,
    help="Longest an HTTP API long poll waits for an effect, in seconds.",
)
@click.option(
    "--console/--no-console",
    "with_console",
    default=True,
    show_default=True,
    help="Serve the operator console at /console.",
)
@click.option("--log-json", is_flag=True, help="Log JSON lines.")
@pass_cli
def serve(
    cli: CliContext,
    host: str,
    allowed_host: tuple[str, ...],
    port: int,
    secret_file: Path | None,
    operator_token_file: Path | None,
    metrics_token_file: Path | None,
    api_token_file: Path | None,
    tolerance: float,
    max_concurrency: int,
    max_connections_per_client: int,
    max_connections: int,
    header_timeout: float,
    body_timeout: float,
    idle_timeout: float,
    max_body_bytes: int,
    max_wait: float,
    with_console: bool,
    log_json: bool,
) -> None:
    """Signed signals, the HTTP API (/api/v1), /healthz, /metrics and the console (/console)."""
    from outbox.cli.logs import configure
    from outbox.serve.app import OutboxServer
    from outbox.serve.settings import Credentials

    settings = _settings(
        host=host,
        allowed_hosts=_host_list(allowed_host),
        port=port,
        tolerance=tolerance,
        max_concurrency=max_concurrency,
        max_connections_per_client=max_connections_per_client,
        max_connections=max_connections,
        header_timeout=header_timeout,
        body_timeout=body_timeout,
        idle_timeout=idle_timeout,
        max_body_bytes=max_body_bytes,
        max_wait=max_wait,
        console=with_console,
    )
    credentials = Credentials.from_env(
        webhook_secret_file=secret_file,
        operator_token_file=operator_token_file,
        metrics_token_file=metrics_token_file,
        api_token_file=api_token_file,
    )
    if credentials.webhook_secret is None and credentials.api_token is None and not with_console:
        raise ConfigurationError(
            "OUTBOX_WEBHOOK_SECRET and OUTBOX_API_TOKEN are not set (or pass --secret-file, "
            "--api-token-file): with no console either, there is nothing to serve"
        )
    configure(logging.INFO, as_json=log_json)
    with listening(host, port):
        can_listen(host, port)
    server = OutboxServer(cli.outbox, settings, credentials)
    log = logging.getLogger("outbox.serve")
    if settings.allowed_hosts is None and host in ("0.0.0.0", "::", ""):
        log.warning(
            "listening on every address but answering only localhost: name the host "
            "names clients use with --allowed-host (or OUTBOX_ALLOWED_HOSTS)"
        )
    log.info(
        "serving on http://%s:%d (signals %s, HTTP API %s, console %s)",
        host,
        port,
        "on" if credentials.webhook_secret else "off: no OUTBOX_WEBHOOK_SECRET",
        "on at /api/v1" if credentials.api_token else "off: no OUTBOX_API_TOKEN",
        ("read-write for the operator" if credentials.operator_token else "read-only")
        if with_console
        else "off",
    )
    # uvicorn stops on SIGTERM/SIGINT, finishing requests in progress.
    server.serve_forever()


@click.command("sink")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65_535),
    default=8080,
    show_default=True,
    help="Port to listen on.",
)
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


COMMANDS = [worker, signal_command, serve, sink]
