"""The delivery store's own connections: statements planned once (one server), sent as compiled."""

from __future__ import annotations

import asyncio

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Integer, Text, bindparam, literal_column, select

from outbox.storage.direct import Prepared
from tests.support import delivery_plan_modes


def test_every_delivery_connection_plans_generically_on_one_server(dsn: str) -> None:
    assert delivery_plan_modes(dsn) == ["force_generic_plan"] * 4


def test_a_prepared_statement_runs_in_postgresqls_own_placeholders(dsn: str) -> None:
    """A name used twice is one ``$n``; ``%`` in the SQL stays; 60 parameters all arrive."""
    many = [bindparam(f"n{i}", type_=Integer) for i in range(60)]
    statement = select(
        (bindparam("a", type_=Integer) + bindparam("a", type_=Integer)).label("twice"),
        literal_column("'100%'").label("percent"),
        bindparam("word", type_=Text).op("||")(literal_column("'%s'")).label("word"),
        sum(many[1:], many[0]).label("total"),
    )
    prepared = Prepared(statement)

    async def run() -> dict[str, object]:
        async with await psycopg.AsyncConnection.connect(
            dsn, autocommit=True, row_factory=dict_row
        ) as conn:
            values = {"a": 21, "word": "x"} | {f"n{i}": i for i in range(60)}
            cursor = await prepared.execute(conn, values, prepare=True)
            row = await cursor.fetchone()
            assert row is not None
            return row

    assert asyncio.run(run()) == {"twice": 42, "percent": "100%", "word": "x%s", "total": 1770}
