"""The delivery store's own connections plan its prepared statements once (one server)."""

from __future__ import annotations

from tests.support import delivery_plan_modes


def test_every_delivery_connection_plans_generically_on_one_server(dsn: str) -> None:
    assert delivery_plan_modes(dsn) == ["force_generic_plan"] * 4
