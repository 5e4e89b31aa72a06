"""The recording deliverer of dry runs: every effect succeeds with a stub, none reaches a sink.

A dry run (``start_run(..., mode="dry_run")``) writes its intents under the
``dry-run:`` kind namespace, which no real deliverer serves and no caller can
name. ``outbox deliver --dry-run`` serves that namespace with
:class:`DryRunDeliverer`: each attempt is recorded (the effect row and its
attempt log are what "would have happened") and answered with

1. the result a real run recorded for the same intent, when ``recorded`` is on:
   the newest live run of the same agent with the same inputs that has a
   succeeded effect at the same step and index (so a dry run of version W sees
   what version V's real run got back);
2. else the stub declared for the kind (``[dry_run.stubs]`` in the deliverers config);
3. else ``default`` (``{"dry_run": true}``).

The attempt log says which (``detail.result_from``). Config::

    [dry_run]
    recorded = true                        # default
    default = { dry_run = true }
    [dry_run.stubs."http.request"]
    result = { status = 200, body = "ok" }
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from outbox.delivery.contract import Deliverer, DelivererConfig, Delivery, Outcome, Succeeded
from outbox.models import DRY_RUN_KIND_PREFIX

__all__ = ["DryRunConfig", "DryRunDeliverer", "DryRunStub", "dry_run_registry"]

#: ``await recorded(effect_id)`` -> ``(found, result)``
RecordedResult = Callable[[UUID], Awaitable[tuple[bool, Any]]]


class DryRunStub(BaseModel):
    """What a dry-run effect of one kind gets back."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The result every dry-run effect of this kind succeeds with (any TOML value).
    result: Any = None


class DryRunConfig(BaseModel):
    """The ``[dry_run]`` table of a deliverers config (read by :mod:`outbox.delivery.config`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: answer with the result a real run of the same agent and inputs recorded, when there is one
    recorded: bool = True
    #: The result of a dry-run effect whose kind has no stub (and no recorded result).
    default: Any = Field(default_factory=lambda: {"dry_run": True})
    #: Stubs by effect kind (``[dry_run.stubs."http.request"]``).
    stubs: dict[str, DryRunStub] = Field(default_factory=dict)


class DryRunDeliverer(Deliverer):
    """Serves ``dry-run:<kind>``: records the attempt and answers with a stub (never calls out)."""

    # Nothing real happens, so a redelivery after a crash is harmless.
    default_idempotent = True

    def __init__(
        self, real_kind: str, config: DryRunConfig, recorded: RecordedResult | None = None
    ) -> None:
        super().__init__(DRY_RUN_KIND_PREFIX + real_kind, DelivererConfig())
        self.real_kind = real_kind
        self._stub = config.stubs.get(real_kind)
        self._default = config.default
        # ``recorded = false``: the stubs answer even where a real run recorded a result.
        self._recorded = recorded if config.recorded else None
        #: every delivery this instance answered (for tests and reports)
        self.deliveries: list[Delivery] = []

    async def deliver(self, delivery: Delivery) -> Outcome:
        """Answer from a recorded result, the kind's stub, or the default; nothing leaves."""
        self.deliveries.append(delivery)
        if self._recorded is not None:
            found, result = await self._recorded(delivery.effect_id)
            if found:
                return Succeeded(result, detail={"dry_run": True, "result_from": "recorded"})
        if self._stub is not None:
            return Succeeded(self._stub.result, detail={"dry_run": True, "result_from": "stub"})
        return Succeeded(self._default, detail={"dry_run": True, "result_from": "default"})


def dry_run_registry(
    kinds: Iterable[str], config: DryRunConfig, recorded: RecordedResult | None
) -> dict[str, Deliverer]:
    """One recording deliverer per kind (and per stubbed kind), keyed by its dry-run kind."""
    return {
        DRY_RUN_KIND_PREFIX + kind: DryRunDeliverer(kind, config, recorded)
        for kind in sorted(set(kinds) | set(config.stubs))
    }
