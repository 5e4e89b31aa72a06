"""A deliverer of one's own: text messages through an HTTP gateway that dedups on a key.

docs/howto/write-a-deliverer.md walks through it. It uses only what
``outbox.delivery`` exports (plus httpx and pydantic), as a deliverer in a
package of your own would. Register it in your package's ``pyproject.toml``::

    [project.entry-points."outbox.deliverers"]
    "sms.send" = "sms_deliverer:SmsDeliverer"

and configure its kind in the deliverers config::

    [kinds."sms.send"]
    base_url = "https://sms.example.com"
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import httpx
from pydantic import BaseModel, ConfigDict, Field

from outbox.delivery import (
    Deliverer,
    DelivererConfig,
    Delivery,
    Failed,
    NotApplied,
    Outcome,
    Retry,
    Succeeded,
)


class Sms(BaseModel):
    """The payload of an ``sms.send`` effect."""

    model_config = ConfigDict(extra="forbid")

    to: str = Field(pattern=r"^\+[0-9]{6,15}$")
    text: str = Field(min_length=1, max_length=1600)


class SmsConfig(DelivererConfig):
    """Settings of the ``sms.send`` kind (its table in the deliverers config)."""

    #: The gateway's base URL: messages are posted to ``{base_url}/messages``.
    base_url: str = "https://sms.example.com"
    #: Seconds one call may take, answer included.
    timeout: float = Field(default=10.0, gt=0, le=60)


class SmsDeliverer(Deliverer[SmsConfig]):
    """Sends one text message per effect; the gateway dedups on ``Idempotency-Key``."""

    #: The gateway applies a key once: a call lost in a crash is safe to send again.
    default_idempotent: ClassVar[bool] = True
    payload_model: ClassVar[type[BaseModel] | None] = Sms

    def __init__(self, kind: str, config: DelivererConfig | None = None) -> None:
        super().__init__(kind, config)
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        # Made on first use, inside the daemon's event loop, which it belongs to.
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.config.base_url, timeout=self.config.timeout
            )
        return self._client

    async def deliver(self, delivery: Delivery) -> Outcome:
        """Post the message once, with the effect's idempotency key."""
        sms: Sms = delivery.payload  # parsed by payload_model before the call
        try:
            response = await self._http().post(
                "/messages",
                json=sms.model_dump(),
                headers={"Idempotency-Key": delivery.idempotency_key},
            )
        except httpx.ConnectError as exc:
            return Retry(f"gateway unreachable: {exc}")  # nothing was sent
        except httpx.TimeoutException:
            # It may have been applied; the gateway dedups on the key, so sending
            # it again is safe (a gateway that cannot dedup would answer Unknown).
            return Retry(f"no answer within {self.config.timeout}s")
        if response.status_code == 429:
            after = _seconds(response.headers.get("Retry-After"))
            return Retry("rate limited by the gateway", after=after, rate_limited=True)
        if response.status_code >= 500:
            return Retry(f"gateway error {response.status_code}")
        if response.status_code >= 400:
            return Failed(
                f"gateway refused the message: {response.status_code}",
                detail={"status": response.status_code, "body": response.text[:500]},
            )
        return Succeeded({"status": response.status_code, "gateway": response.json()})

    async def lookup(self, delivery: Delivery) -> Any:
        """Ask the gateway whether the key was applied (the reconciler calls this)."""
        response = await self._http().get(f"/idempotency/{delivery.idempotency_key}")
        if response.status_code == 404:
            return NotApplied()
        response.raise_for_status()  # anything else: the reconciler asks again later
        return Succeeded(response.json())

    async def aclose(self) -> None:
        """Close the HTTP client on the loop it was made on."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _seconds(value: str | None) -> float | None:
    """``Retry-After`` in seconds; anything else (an HTTP date, garbage) is left to the backoff."""
    try:
        seconds = float(value) if value else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None
