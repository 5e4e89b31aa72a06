"""docs/howto/write-a-deliverer.md, as tests: the example deliverer written, registered, tested.

``examples/sms_deliverer.py`` is called directly against a real idempotent
HTTP sink, then registered through an ``outbox.deliverers`` entry point (a
dist-info directory on the path, as ``pip install`` would leave) and delivered
by a real ``outbox deliver`` process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from deliverers.testing import Fault, IdempotentHttpSink, RecordingDeliverer
from outbox import Outbox
from outbox.delivery import Delivery, Failed, NotApplied, Outcome, Retry, Succeeded
from tests.support import DaemonThread, wait_for

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from sms_deliverer import SmsDeliverer  # noqa: E402


def _delivery(payload: Any, key: str = "key-1", attempt: int = 1) -> Delivery:
    deliverer = SmsDeliverer("sms.send")
    return Delivery(
        effect_id=uuid.uuid4(),
        run_id=None,
        kind="sms.send",
        payload=deliverer.parse_payload(payload),
        idempotency_key=key,
        attempt=attempt,
    )


def _call(deliverer: SmsDeliverer, *deliveries: Delivery, lookup: bool = False) -> list[Any]:
    async def main() -> list[Any]:
        try:
            call = deliverer.lookup if lookup else deliverer.deliver
            return [await call(d) for d in deliveries]
        finally:
            await deliverer.aclose()

    return asyncio.run(main())


MESSAGE = {"to": "+4915112345678", "text": "Your refund of 5 EUR is on its way."}


def test_each_key_is_applied_once_and_the_lookup_finds_it() -> None:
    with IdempotentHttpSink() as sink:
        deliverer = SmsDeliverer.from_config("sms.send", {"base_url": sink.url})
        assert isinstance(deliverer, SmsDeliverer)
        first, again = _call(deliverer, _delivery(MESSAGE), _delivery(MESSAGE, attempt=2))
        assert isinstance(first, Succeeded) and isinstance(again, Succeeded)
        assert sink.stats()["keys_applied"] == 1
        found, missing = _call(
            deliverer, _delivery(MESSAGE), _delivery(MESSAGE, key="never-sent"), lookup=True
        )
        assert isinstance(found, Succeeded) and isinstance(missing, NotApplied)


def test_failures_map_to_outcomes() -> None:
    with IdempotentHttpSink() as sink:
        deliverer = SmsDeliverer.from_config("sms.send", {"base_url": sink.url})
        sink.inject(Fault("429", times=1, retry_after="7"))
        sink.inject(Fault("500_after", times=1))
        limited, broken, retried = _call(
            deliverer, *(_delivery(MESSAGE, attempt=n) for n in (1, 2, 3))
        )
        assert isinstance(limited, Retry) and limited.rate_limited and limited.after == 7.0
        assert isinstance(broken, Retry)  # applied, then a 500: the retry is deduplicated
        assert isinstance(retried, Succeeded)
        assert sink.stats()["keys_applied"] == 1
        (refused,) = _call(deliverer, _delivery({**MESSAGE, "text": "other"}))  # same key
        assert isinstance(refused, Failed) and "422" in refused.reason


def test_bad_payloads_and_settings_are_refused_by_their_models() -> None:
    with pytest.raises(Exception, match="to"):
        SmsDeliverer("sms.send").parse_payload({"to": "not a number", "text": "hi"})
    with pytest.raises(Exception, match="timeout"):
        SmsDeliverer.from_config("sms.send", {"timeout": 0})


def _register(site: Path) -> None:
    """What ``pip install`` of a package declaring the entry point leaves on the path."""
    info = site / "sms_example-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sms-example\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[outbox.deliverers]\nsms.send = sms_deliverer:SmsDeliverer\n"
    )


def test_registered_by_entry_point_outbox_deliver_delivers_it(
    ob: Outbox, sub_env: dict[str, str], tmp_path: Path
) -> None:
    site = tmp_path / "site"
    _register(site)
    with IdempotentHttpSink() as sink:
        config = tmp_path / "deliverers.toml"
        config.write_text(f'[kinds."sms.send"]\nbase_url = "{sink.url}"\n')
        with ob.transaction() as tx:
            for n in range(5):
                tx.intend("sms.send", {**MESSAGE, "text": f"message {n}"})
        env = {
            **sub_env,
            "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "examples"), str(ROOT)]),
        }
        log = tmp_path / "deliver.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "outbox", "deliver", "--config", str(config)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(
                lambda: [e.status.value for e in ob.effects(kind="sms.send")] == ["succeeded"] * 5,
                timeout=60,
                message=f"outbox deliver to deliver sms.send: {log}",
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        assert sink.stats()["keys_applied"] == 5
    assert proc.returncode == 0, log.read_text()


def test_a_recording_deliverer_stands_in_for_it_in_an_agent_test(ob: Outbox, dsn: str) -> None:
    def busy_then_done(delivery: Delivery) -> Outcome:
        return Retry("gateway busy", after=0.1) if delivery.attempt == 1 else Succeeded("ok")

    recorder = RecordingDeliverer("sms.send", outcome=busy_then_done)
    with ob.transaction() as tx:
        effect = tx.intend("sms.send", MESSAGE)
    with DaemonThread(dsn, {"sms.send": recorder}):
        wait_for(lambda: ob.effect(effect.id).status.value == "succeeded", message="delivered")
    assert recorder.keys == [effect.idempotency_key] * 2
    assert [d.attempt for d in recorder.deliveries] == [1, 2]
