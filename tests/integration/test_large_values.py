"""Large values by reference: claims return the reference, calls get the value.

A claim never reads a blob (its rows stay small, whatever the payload); the
daemon reads one payload just before calling the deliverer with it. A wait
that records a reference keeps the value for its run.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import psycopg
import pytest
from sqlalchemy import text

from deliverers.testing import RecordingDeliverer
from outbox import Outbox
from outbox.blobs import is_reference
from outbox.shards import on_shard, shard_of
from outbox.storage.async_store import AsyncStore
from outbox.storage.dsn import libpq_dsn
from outbox.storage.engine import make_async_engine
from outbox.storage.run_tx import RunTx
from outbox.storage.sql import blobs as blob_sql
from outbox.storage.sql.queue import EFFECT_QUEUE
from tests.support import DaemonThread, wait_for

BIG = {"document": "x" * (5 * 1024 * 1024)}


def test_a_claim_returns_the_reference_and_the_deliverer_gets_the_payload(
    ob: Outbox, dsn: str
) -> None:
    run = ob.start_run("agent", "1")
    run.transaction("s", lambda tx: tx.intend("k.big", BIG) and None)

    async def claim_and_read() -> tuple[object, object]:
        store = AsyncStore(make_async_engine(dsn))
        try:
            (claimed,) = await store.claim_many(
                EFFECT_QUEUE, [({"kind": "k.big"}, 10)], owner="t", lease_seconds=1
            )
            return claimed.payload, (await store.with_payload(claimed)).payload
        finally:
            await store.dispose()

    as_claimed, as_read = asyncio.run(claim_and_read())
    assert is_reference(as_claimed) and as_read == BIG


def test_the_daemon_delivers_a_large_payload_whole(ob: Outbox, dsn: str) -> None:
    run = ob.start_run("agent", "1")
    run.transaction(
        "s", lambda tx: [tx.intend("k.big", {**BIG, "n": n}) for n in range(3)] and None
    )
    recorder = RecordingDeliverer("k.big")
    with DaemonThread(dsn, {"k.big": recorder}, poll_seconds=0.1):
        wait_for(lambda: len(ob.effects(status="succeeded")) == 3, timeout=60)
    assert sorted(d.payload["n"] for d in recorder.deliveries) == [0, 1, 2]
    assert all(d.payload["document"] == BIG["document"] for d in recorder.deliveries)


def test_a_wait_that_records_another_owners_stored_value_keeps_it_for_its_run(
    ob: Outbox,
) -> None:
    """``outbox_complete_wait`` may be handed a reference to a value another run stored
    (on the run's shard): the run uses it from then on, so ``outbox gc`` keeps it
    (no reference of the run was recorded, and gc could take it from under the run)."""
    stored = ob.start_run("blob-owner", "1")
    stored.transaction("big", lambda tx: {"document": "y" * 20_000})
    reader = ob.start_run("blob-reader", "1", run_id=on_shard(uuid.uuid4(), shard_of(stored.id)))
    with ob.engine.begin() as conn:
        reference = conn.execute(
            text("SELECT result FROM outbox_steps WHERE run_id = :r AND step_id = 'big'"),
            {"r": stored.id},
        ).scalar_one()
        assert is_reference(reference)
        tx = RunTx(conn)
        tx.record_wait(reader.id, "w", kind="sleep", seconds=3600, until=None, detail={})
        tx.complete_wait(reader.id, "w", result=reference)
    with ob.engine.connect() as conn:
        owners = conn.execute(
            text("SELECT owner FROM outbox_blob_refs WHERE sha256 = :sha ORDER BY owner"),
            {"sha": reference["__outbox_blob__"]["sha256"]},
        ).scalars()
        assert set(owners) == {stored.id, reader.id}
    assert ob.verify_run(reader.id) == []


#: Holds a writer between its blob and its reference while a test's lock is held.
_GATE = """
CREATE FUNCTION test_gc_gate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_lock_shared(4242);
    PERFORM pg_advisory_unlock_shared(4242);
    RETURN NEW;
END $$;
CREATE TRIGGER test_gc_gate BEFORE INSERT ON outbox_blob_refs
    FOR EACH ROW EXECUTE FUNCTION test_gc_gate();
"""


@pytest.mark.parametrize("writer", ["signal", "start_run"])
def test_outbox_gc_leaves_a_value_a_writer_found_already_stored(
    ob: Outbox, dsn: str, writer: str
) -> None:
    """A writer leaves a blob already there as it is (it may be another namespace's,
    which it could not update): it must still hold it, or `outbox gc` could take
    one nothing used yet between the blob and its use, and the writer failed on
    the foreign key (Python's put for a signal, SQL's outbox_store_value for inputs)."""
    value = {"text": "g" * 40_000}
    run = ob.start_run("gc-race", "1")
    shard = shard_of(run.id)
    # the value stored once, the same way, and then used by nothing (its run's use gone)
    spare = ob.start_run(
        "gc-race",
        "1",
        inputs=value if writer == "start_run" else None,
        run_id=on_shard(uuid.uuid4(), shard),
    )
    if writer == "signal":
        ob.signal(spare.id, "doc", value)
    with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
        conn.execute("DELETE FROM outbox_blob_refs WHERE owner = %s", (spare.id,))
        conn.execute(_GATE)
    try:
        with psycopg.connect(libpq_dsn(dsn), autocommit=True) as gate:
            gate.execute("SELECT pg_advisory_lock(4242)")
            done: list[object] = []

            def write() -> None:
                if writer == "signal":
                    done.append(ob.signal(run.id, "doc", value))
                else:
                    done.append(
                        ob.start_run(
                            "gc-race", "1", inputs=value, run_id=on_shard(uuid.uuid4(), shard)
                        )
                    )

            thread = threading.Thread(target=write)
            thread.start()
            wait_for(
                lambda: (
                    gate.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
                    ).fetchone()
                    == (1,)
                )
            )
            # gc's own statement (skipping locked rows) leaves it: the writer holds it
            with ob.engine.begin() as sa_gc:
                taken = sa_gc.execute(blob_sql.delete_unused_blobs(rows=False), {"batch": 100})
                assert taken.rowcount == 0
            gate.execute("SELECT pg_advisory_unlock(4242)")
            thread.join(30)
        assert len(done) == 1, "the writer failed"
    finally:
        with psycopg.connect(libpq_dsn(dsn), autocommit=True) as conn:
            conn.execute("DROP TRIGGER test_gc_gate ON outbox_blob_refs")
            conn.execute("DROP FUNCTION test_gc_gate()")
    owner = run.id if writer == "signal" else done[0].id  # type: ignore[attr-defined]
    with ob.engine.connect() as sa_conn:
        used = sa_conn.execute(
            text(
                "SELECT count(*) FROM outbox_blob_refs f JOIN outbox_blobs b USING (sha256, shard)"
                " WHERE f.owner = :o"
            ),
            {"o": owner},
        ).scalar_one()
    assert used == 1
    if writer == "start_run":
        assert ob.run(owner).inputs == value
