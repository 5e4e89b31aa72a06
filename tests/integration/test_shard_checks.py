"""The tables' shard checks, spelled out (migrations 0045, 0046), agree with the shard functions.

The checks no longer call ``outbox_shard_of`` and ``outbox_key_shard``
(``outbox.storage.schema_base.shard_check`` says why): each is the same formula
written out, and the three (Python, the SQL functions, the checks) must give
every row the same shard, or a key or a run is refused where the client put it.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from outbox.shards import SHARDS, key_shard, shard_of

#: keys whose bytes the SQL formula must read as Python does: backslashes (which
#: decode's escape would otherwise read), multi-byte UTF-8, the 0x1f separator
KEYS = [
    "plain",
    "back\\slash",
    "\\\\double",
    "trailing\\",
    "café-漢字-🙂",
    "sep\x1finside",
    "x" * 300,
    *(f"k-{n}" for n in range(64)),
]


def test_the_key_checks_take_each_key_on_its_own_shard_and_refuse_it_elsewhere(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        for key in KEYS:
            shard = key_shard("ns\\1", key)
            assert conn.execute("SELECT outbox_key_shard(%s, %s)", ["ns\\1", key]).fetchone() == (
                shard,
            )
            for table, extra, values in (
                ("outbox_run_keys", "", ""),
                ("outbox_effect_keys", ", kind, payload_hash, effect_id", ", 'k', 'h', %(run)s"),
            ):
                insert = (
                    f"INSERT INTO {table} (namespace, key, shard, run_id{extra})"
                    f" VALUES (%(ns)s, %(key)s, %(shard)s, %(run)s{values})"
                )
                params = {"ns": "ns\\1", "key": key, "run": uuid.uuid4()}
                with conn.transaction(force_rollback=True):
                    conn.execute(insert, {**params, "shard": shard})
                wrong = (shard + 1) % SHARDS
                with (
                    pytest.raises(psycopg.errors.CheckViolation, match=f"{table}_shard_check"),
                    conn.transaction(force_rollback=True),
                ):
                    conn.execute(insert, {**params, "shard": wrong})


def test_the_id_checks_take_each_run_on_its_own_shard_and_refuse_it_elsewhere(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        for n in range(64):
            run = uuid.uuid4()
            shard = shard_of(run)
            assert conn.execute("SELECT outbox_shard_of(%s)", [run]).fetchone() == (shard,)
            insert = (
                "INSERT INTO outbox_runs (id, shard, agent, agent_version, status, inputs,"
                " inputs_hash) VALUES (%s, %s, 'a', '1', 'runnable', '{}', 'h')"
            )
            with conn.transaction(force_rollback=True):
                conn.execute(insert, [run, shard])
            with (
                pytest.raises(psycopg.errors.CheckViolation, match="outbox_runs_shard_check"),
                conn.transaction(force_rollback=True),
            ):
                conn.execute(insert, [run, (shard + 1 + n % 31) % SHARDS])
