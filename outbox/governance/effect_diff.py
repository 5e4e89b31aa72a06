"""What two runs intended, side by side: the effects of a dry run against a real one, say.

Effects are matched by where they were intended (step id, index in the step);
for each, the comparison looks at what the intent *says*: its kind (a dry
run's without the ``dry-run:`` prefix), payload, compensation, ordering key and
idempotency key. A run's own id inside those values (an ``operation`` field
that embeds it, say) is written ``{run}`` on both sides, and a key derived
from (run, step, index) is written ``(derived)``, so two runs that intend the
same things compare equal. Delivery state and results are shown, not compared.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox.keys import derive_key
from outbox.models import DRY_RUN_KIND_PREFIX, Effect, real_kind

__all__ = ["COMPARED", "EffectChange", "RunDiff", "diff_effects", "intended"]

#: The fields of an intent the comparison looks at.
COMPARED = ("kind", "payload", "compensate", "ordering_key", "key")
RUN_PLACEHOLDER = "{run}"


def _normalise(value: Any, run_id: str) -> Any:
    if isinstance(value, str):
        return value.replace(run_id, RUN_PLACEHOLDER)
    if isinstance(value, list):
        return [_normalise(v, run_id) for v in value]
    if isinstance(value, dict):
        return {_normalise(k, run_id): _normalise(v, run_id) for k, v in value.items()}
    return value


def _key(effect: Effect, run_id: uuid.UUID) -> str:
    key = effect.idempotency_key
    if (
        effect.step_id is not None
        and effect.step_index is not None
        and key == derive_key(run_id, effect.step_id, effect.step_index)
    ):
        return "(derived)"
    return key.removeprefix(f"{DRY_RUN_KIND_PREFIX}{run_id}:")


def intended(effect: Effect, run_id: uuid.UUID) -> dict[str, Any]:
    """What an effect's intent says, with its run's own id written ``{run}``."""
    rid = str(run_id)
    compensate = None
    if effect.compensate is not None:
        compensate = {
            "kind": real_kind(effect.compensate.kind),
            "payload": _normalise(effect.compensate.payload, rid),
        }
    return {
        "kind": real_kind(effect.kind),
        "payload": _normalise(effect.payload, rid),
        "compensate": compensate,
        "ordering_key": _normalise(effect.ordering_key, rid),
        "key": _normalise(_key(effect, run_id), rid),
    }


@dataclass(frozen=True)
class EffectChange:
    """Where the runs differ: ``added`` (only in B), ``removed`` (only in A), ``changed``."""

    step_id: str | None
    index: int | None
    change: str
    fields: tuple[str, ...] = ()
    a: dict[str, Any] | None = None
    b: dict[str, Any] | None = None


@dataclass(frozen=True)
class RunDiff:
    """The effects of run ``a`` against run ``b``."""

    run_a: uuid.UUID
    run_b: uuid.UUID
    compared: int
    changes: list[EffectChange] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        """True when both runs intended the same effects."""
        return not self.changes

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "run_a": str(self.run_a),
            "run_b": str(self.run_b),
            "compared": self.compared,
            "identical": self.identical,
            "changes": [
                {
                    "step_id": c.step_id,
                    "index": c.index,
                    "change": c.change,
                    "fields": list(c.fields),
                    "a": c.a,
                    "b": c.b,
                }
                for c in self.changes
            ],
        }


def diff_effects(
    run_a: uuid.UUID, effects_a: Sequence[Effect], run_b: uuid.UUID, effects_b: Sequence[Effect]
) -> RunDiff:
    """Compare what two runs intended, position by position (in intent order)."""

    def by_position(run_id: uuid.UUID, found: Sequence[Effect]) -> dict[Any, dict[str, Any]]:
        return {
            (e.step_id, e.step_index, e.compensates is not None): intended(e, run_id) for e in found
        }

    a, b = by_position(run_a, effects_a), by_position(run_b, effects_b)
    order = list(a) + [p for p in b if p not in a]
    changes: list[EffectChange] = []
    for position in order:
        step_id, index, _ = position
        left, right = a.get(position), b.get(position)
        if right is None:
            changes.append(EffectChange(step_id, index, "removed", a=left))
        elif left is None:
            changes.append(EffectChange(step_id, index, "added", b=right))
        else:
            differ = tuple(name for name in COMPARED if left[name] != right[name])
            if differ:
                changes.append(EffectChange(step_id, index, "changed", differ, left, right))
    return RunDiff(run_a, run_b, len(order), changes)
