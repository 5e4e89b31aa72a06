"""The stopping sweep on a cluster (a module of its own: its database holds no other runs)."""

from __future__ import annotations

from outbox import Outbox
from tests.integration.test_stopping_sweep import a_run_behind_a_full_page_is_ended


def test_the_stopping_sweep_goes_on_shard_by_shard_after_its_last_page(
    ob: Outbox, dsn: str
) -> None:
    """Its pages are in (shard, last change, id) order: no shard's stuck runs hold it."""
    a_run_behind_a_full_page_is_ended(ob, dsn)
