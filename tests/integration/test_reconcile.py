"""The reconciler resolves lost attempts by what deliverers declare; operators close unknowns."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from deliverers.http import HttpDeliverer
from deliverers.testing import IdempotentHttpSink, RecordingDeliverer
from outbox import EffectStatus, Outbox, RunStateError
from outbox.cli import cli
from outbox.delivery import Deliverer
from outbox.delivery.reconcile import LookupBackoff, ReconcileReport, reconcile
from outbox.storage.async_store import AsyncStore
from outbox.storage.engine import make_async_engine
from outbox.storage.sql.queue import EFFECT_QUEUE


def intend(ob: Outbox, kind: str, payloads: list[Any]) -> None:
    run = ob.start_run("agent", "1")
    run.transaction(f"s-{kind}", lambda tx: [tx.intend(kind, p) for p in payloads] and None)


def lose_attempts(dsn: str, kinds: list[str], owner: str = "dead-deliverer") -> None:
    """Claim every pending effect as a deliverer that then dies: leases expire at once."""

    async def main() -> None:
        store = AsyncStore(make_async_engine(dsn))
        try:
            await store.claim_many(
                EFFECT_QUEUE,
                [({"kind": k}, 1000) for k in kinds],
                owner=owner,
                lease_seconds=0.001,
            )
        finally:
            await store.dispose()

    asyncio.run(main())


def run_reconcile(dsn: str, deliverers: dict[str, Deliverer], **kw: Any) -> ReconcileReport:
    async def main() -> ReconcileReport:
        store = AsyncStore(make_async_engine(dsn))
        try:
            return await reconcile(store, deliverers, worker="test-reconciler", **kw)
        finally:
            for d in deliverers.values():
                await d.aclose()
            await store.dispose()

    return asyncio.run(main())


def by_kind(ob: Outbox) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for e in ob.effects(limit=1000):
        found.setdefault(e.kind, []).append(e.status.value)
    return found


def test_each_declaration_has_its_resolution(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.idem", [{"i": 1}, {"i": 2}])
    intend(ob, "k.blind", [{"i": 3}])
    lose_attempts(dsn, ["k.idem", "k.blind"])
    deliverers: dict[str, Deliverer] = {
        "k.idem": RecordingDeliverer("k.idem", idempotent=True),
        "k.blind": RecordingDeliverer("k.blind", idempotent=False),
    }

    dry = run_reconcile(dsn, deliverers, dry_run=True)
    assert dry.counts == {"redeliver": 2, "unknown": 1}
    assert by_kind(ob) == {"k.idem": ["in_flight"] * 2, "k.blind": ["in_flight"]}, "dry run"

    report = run_reconcile(dsn, deliverers)
    assert report.counts == {"redeliver": 2, "unknown": 1}
    assert by_kind(ob) == {"k.idem": ["pending"] * 2, "k.blind": ["unknown"]}
    blind = ob.effects(kind="k.blind")[0]
    assert "an operator must resolve it" in (blind.last_error or "")
    assert [(a.attempt, a.outcome) for a in ob.store.attempts(blind.id)] == [(1, "expired")]
    assert run_reconcile(dsn, deliverers).counts == {}, "nothing left to do"


def test_lookup_asks_the_sink(ob: Outbox, dsn: str) -> None:
    with IdempotentHttpSink() as sink:
        intend(
            ob, "http.request", [{"url": f"{sink.url}/ledger", "json": {"n": n}} for n in (1, 2)]
        )
        applied, missing = ob.effects()
        # The first call reached the sink before its deliverer died; the second did not.
        httpx.post(
            f"{sink.url}/ledger",
            json={"n": 1},
            headers={"Idempotency-Key": applied.idempotency_key},
        )
        lose_attempts(dsn, ["http.request"])
        lookup = HttpDeliverer.from_config(
            "http.request",
            {
                "idempotent": False,
                "allow_private": ["127.0.0.1"],
                "lookup_url": sink.url + "/idempotency/{key}",
            },
        )
        report = run_reconcile(dsn, {"http.request": lookup})
    assert sorted(report.counts.items()) == [("looked_up_redeliver", 1), ("looked_up_succeeded", 1)]
    assert ob.effect(applied.id).status == EffectStatus.SUCCEEDED
    assert ob.effect(applied.id).result["looked_up"] is True
    assert ob.effect(missing.id).status == EffectStatus.PENDING
    assert [a.outcome for a in ob.store.attempts(applied.id)] == ["looked_up"]


def _lookup_at(base: str) -> HttpDeliverer:
    config = {"idempotent": False, "allow_private": ["127.0.0.1"]}
    return HttpDeliverer.from_config(
        "http.request", {**config, "lookup_url": base + "/idempotency/{key}"}
    )


def test_a_sink_that_cannot_be_asked_leaves_the_effect_unknown_and_is_asked_less_often(
    ob: Outbox, dsn: str
) -> None:
    with socket.socket() as probe:  # a port nobody listens on: every lookup fails at once
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with IdempotentHttpSink() as sink:
        intend(ob, "http.request", [{"url": f"{sink.url}/ledger", "json": {"n": 1}}])
        (effect,) = ob.effects()
        httpx.post(
            f"{sink.url}/ledger", json={"n": 1}, headers={"Idempotency-Key": effect.idempotency_key}
        )
        lose_attempts(dsn, ["http.request"])
        lookups = LookupBackoff(floor=60.0)
        report = run_reconcile(dsn, {"http.request": _lookup_at(dead)}, lookups=lookups)
        # Not left in flight under the reconciler's lease, out of an operator's sight.
        assert report.counts == {"unknown": 1}
        assert ob.effect(effect.id).status == EffectStatus.UNKNOWN
        assert "could not be asked" in (ob.effect(effect.id).last_error or "")
        # The next round does not ask a sink that just failed (it could stall every round).
        again = run_reconcile(dsn, {"http.request": _lookup_at(dead)}, lookups=lookups)
        assert again.counts == {}
        # Once the sink answers, the unknown effect is settled by asking, not resent.
        lookups.forget()
        settled = run_reconcile(dsn, {"http.request": _lookup_at(sink.url)}, lookups=lookups)
        assert settled.counts == {"looked_up_succeeded": 1}
        assert sink.state.received[effect.idempotency_key] == 1
    assert ob.effect(effect.id).status == EffectStatus.SUCCEEDED
    assert [a.outcome for a in ob.store.attempts(effect.id)] == ["unknown", "looked_up"]


def test_two_reconcilers_at_once_resolve_each_attempt_once(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.idem", [{"i": i} for i in range(40)])
    intend(ob, "k.blind", [{"i": i} for i in range(40)])
    lose_attempts(dsn, ["k.idem", "k.blind"])

    async def both() -> list[ReconcileReport]:
        stores = [AsyncStore(make_async_engine(dsn)) for _ in range(2)]
        deliverers: dict[str, Deliverer] = {
            "k.idem": RecordingDeliverer("k.idem", idempotent=True),
            "k.blind": RecordingDeliverer("k.blind", idempotent=False),
        }
        try:
            return list(
                await asyncio.gather(
                    *(reconcile(s, deliverers, worker=f"r{i}") for i, s in enumerate(stores))
                )
            )
        finally:
            for s in stores:
                await s.dispose()

    reports = asyncio.run(both())
    total: dict[str, int] = {}
    for report in reports:
        for action, n in report.counts.items():
            total[action] = total.get(action, 0) + n
    assert total == {"redeliver": 40, "unknown": 40}
    for effect in ob.effects(limit=1000):
        assert [a.outcome for a in ob.store.attempts(effect.id)] == ["expired"]


def test_idempotent_effect_that_keeps_killing_deliverers_fails_at_max_attempts(
    ob: Outbox, dsn: str
) -> None:
    intend(ob, "k.idem", [{"poison": True}])
    deliverers: dict[str, Deliverer] = {"k.idem": RecordingDeliverer("k.idem")}
    deliverers["k.idem"].max_attempts = 3
    for _ in range(3):
        lose_attempts(dsn, ["k.idem"])
        run_reconcile(dsn, deliverers)
    effect = ob.effects()[0]
    assert effect.status == EffectStatus.FAILED
    assert "gave up after 3 attempts" in (effect.last_error or "")


def _cli(dsn: str, *args: str) -> Any:
    result = CliRunner().invoke(cli, ["--dsn", dsn, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in args else result.output


def test_operator_workflow_through_the_cli(ob: Outbox, dsn: str) -> None:
    intend(ob, "http.request", [{"url": "https://example.com/a"}])
    intend(
        ob,
        "smtp.send",
        [{"to": ["a@example.com"], "subject": "hi"}, {"to": ["b@example.com"], "subject": "hi"}],
    )
    lose_attempts(dsn, ["http.request", "smtp.send"])

    dry = _cli(dsn, "reconcile", "--dry-run", "--json")
    assert dry["dry_run"] is True and dry["counts"] == {"redeliver": 1, "unknown": 2}
    assert dry["unknown"] == []

    report = _cli(dsn, "reconcile", "--json")
    assert report["counts"] == {"redeliver": 1, "unknown": 2}
    unknown = sorted(report["unknown"], key=lambda e: e["id"])
    assert len(unknown) == 2 and all(e["kind"] == "smtp.send" for e in unknown)
    assert "reconcile" in _cli(dsn, "reconcile")  # the table for people

    sent, not_sent = unknown
    done = _cli(
        dsn,
        "effects",
        "resolve",
        sent["id"],
        "--as",
        "succeeded",
        "--note",
        "found it in the mail server log",
        "--by",
        "alice",
        "--json",
    )
    assert done["status"] == "succeeded"
    again = _cli(
        dsn,
        "effects",
        "resolve",
        not_sent["id"],
        "--as",
        "retry",
        "--note",
        "not in the log",
        "--json",
    )
    assert again["status"] == "pending"
    log = ob.store.attempts(ob.effect(sent["id"]).id)
    assert log[-1].outcome == "resolved"
    assert log[-1].detail == {
        "as": "succeeded",
        "note": "found it in the mail server log",
        "by": "alice",
    }
    with pytest.raises(RunStateError, match="not unknown"):
        ob.resolve_effect(sent["id"], outcome="failed", note="x", operator="bob")


def test_retry_puts_a_failed_effect_back_with_more_attempts(ob: Outbox, dsn: str) -> None:
    intend(ob, "k.x", [{"i": 1}])
    with ob.engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox_effects SET status = 'failed', attempt = 5, last_error = 'HTTP 400'"
        )
    effect = ob.effects()[0]
    retried = _cli(dsn, "effects", "retry", str(effect.id), "--attempts", "2", "--json")
    assert retried["status"] == "pending" and retried["max_attempts"] == 7
    assert ob.store.attempts(effect.id)[-1].outcome == "retried"
    with pytest.raises(RunStateError, match="not failed"):
        ob.retry_effect(effect.id, operator="bob")
