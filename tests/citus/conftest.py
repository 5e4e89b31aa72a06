"""The Citus tests: one real cluster (a coordinator and two workers) per session.

Every test here is marked ``citus``: CI runs them (the cluster comes from the
Citus files that ``.ci/run`` installs); ``-m 'not citus'`` leaves them out
locally. Without the Citus files they fail, naming ``OUTBOX_CITUS_DIR``; they
never skip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from click.testing import CliRunner

from outbox import Outbox
from outbox.cli import cli as cli_main
from tests.citus_support import CitusCluster, CitusDatabase, running_cluster


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the group
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/citus/" in str(item.fspath):
            item.add_marker(pytest.mark.citus)
            # One cluster per session: under pytest-xdist every Citus test goes to one worker.
            item.add_marker(pytest.mark.xdist_group("citus"))


@pytest.fixture(scope="session")
def citus_cluster() -> Iterator[CitusCluster]:
    """A coordinator and two workers on loopback, started once, stopped at the end."""
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture
def citus_db(citus_cluster: CitusCluster) -> Iterator[CitusDatabase]:
    """A fresh database with Citus on every node and the workers registered, for one test."""
    database = citus_cluster.create_database()
    yield database
    citus_cluster.drop_database(database)


@pytest.fixture(scope="module")
def citus_module_db(citus_cluster: CitusCluster) -> Iterator[CitusDatabase]:
    """The same, shared by the tests of one module (a schema built once)."""
    database = citus_cluster.create_database()
    yield database
    citus_cluster.drop_database(database)


@pytest.fixture(scope="module")
def dsn(citus_module_db: CitusDatabase) -> str:
    """The coordinator of a cluster whose schema ``outbox migrate --distribute`` built."""
    result = CliRunner().invoke(
        cli_main, ["migrate", "--distribute", "--json"], env={"OUTBOX_DSN": citus_module_db.dsn}
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert "outbox_effects" in report["distributed"]
    return citus_module_db.dsn


@pytest.fixture
def ob(dsn: str) -> Iterator[Outbox]:
    """A client of ``dsn`` (a module may name another ``dsn``)."""
    outbox = Outbox.connect(dsn)
    yield outbox
    outbox.close()
