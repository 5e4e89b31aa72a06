"""The ``outbox_check`` pytest fixture (a ``pytest11`` entry point: installed, it is there).

::

    from myapp.agents import reconcile

    def test_reconcile_survives_crashes(outbox_check):
        outbox_check(reconcile, inputs={"month": "2026-10"})

The fixture runs :func:`outbox.check.check_agent` and fails the test with
the rendered report when any crash point shows a violation; it returns the
:class:`~outbox.check.report.CheckReport` otherwise. Scratch databases are
made on one temporary embedded PostgreSQL per test session, or on the server
of ``--outbox-check-dsn`` / ``OUTBOX_CHECK_DSN`` (override the
``outbox_check_server`` fixture to use one of your own).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from outbox.check.report import CheckReport

__all__ = ["OutboxCheck", "outbox_check", "outbox_check_server", "pytest_addoption"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--outbox-check-dsn``: make the scratch databases on this server."""
    group = parser.getgroup("outbox", "agent-outbox crash checks")
    group.addoption(
        "--outbox-check-dsn",
        default=None,
        help="PostgreSQL server for outbox_check's scratch databases "
        "(default: OUTBOX_CHECK_DSN, else a temporary embedded server).",
    )


def handler_path(handler: Callable[..., Any] | str) -> str:
    """``module:function`` of a module-level function (what a worker process can import)."""
    if isinstance(handler, str):
        return handler
    module = getattr(handler, "__module__", None)
    name = getattr(handler, "__qualname__", None)
    if not module or not name or "<locals>" in name or "<lambda>" in name or module == "__main__":
        raise TypeError(
            f"handler={handler!r}: outbox_check runs it in worker processes, so it must be "
            "a function defined at the top level of an importable module"
        )
    return f"{module}:{name}"


class OutboxCheck:
    """The fixture's value: call it with a handler to check it."""

    def __init__(self, server_dsn: str) -> None:
        self.server_dsn = server_dsn

    def __call__(
        self,
        handler: Callable[..., Any] | str,
        *,
        inputs: Any = None,
        agent: str | None = None,
        version: str = "1",
        runs: int = 1,
        signals: Mapping[str, Any] | None = None,
        sink: str = "record",
        config: Path | None = None,
        upgrade_to: str | None = None,
        setup: Callable[..., Any] | str | None = None,
        upgrade_handler: Callable[..., Any] | str | None = None,
        only: Sequence[str] = (),
        jobs: int = 4,
        timeout: float = 120.0,
        allow_nondeterministic_result: bool = False,
    ) -> CheckReport:
        """Check ``handler``; fail the test with the report on any violation."""
        from outbox.check.check import check_agent
        from outbox.check.plan import CheckOptions
        from outbox.check.report import plain_text

        path = handler_path(handler)
        options = CheckOptions(
            handler=path,
            agent=agent or path.replace(":", "."),
            version=version,
            inputs={} if inputs is None else inputs,
            runs=runs,
            signals=dict(signals or {}),
            sink=sink,
            config=config,
            upgrade_to=upgrade_to,
            setup=None if setup is None else handler_path(setup),
            upgrade_handler=None if upgrade_handler is None else handler_path(upgrade_handler),
            only=tuple(only),
            jobs=jobs,
            timeout=timeout,
            allow_nondeterministic_result=allow_nondeterministic_result,
        )
        report = check_agent(options, server_dsn=self.server_dsn)
        if not report.ok:
            pytest.fail(plain_text(report), pytrace=False)
        return report


@pytest.fixture(scope="session")
def outbox_check_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """A server for scratch databases, for the whole session."""
    from outbox.check.check import scratch_server

    dsn = request.config.getoption("outbox_check_dsn") or os.environ.get("OUTBOX_CHECK_DSN")
    with scratch_server(dsn) as server:
        yield server


@pytest.fixture
def outbox_check(outbox_check_server: str) -> OutboxCheck:
    """Check an agent handler against every crash point: ``outbox_check(handler, inputs=...)``."""
    return OutboxCheck(outbox_check_server)
