"""Approval gates: which intents wait for a person, and what happens when nobody answers.

A gate names an effect kind and, optionally, conditions on the payload; an
intent of that kind whose payload meets every condition commits as
``awaiting_approval`` and is never claimed until a person approves *its*
payload (by digest). The rule language is deliberately small, so that
PostgreSQL evaluates it inside the statement that writes the intent (no
round trip, and no client can skip it):

- a condition is ``{pointer, op, value}``: ``pointer`` is a JSON Pointer
  (RFC 6901) into the payload (``""`` is the whole payload, ``/json/amount``
  the ``amount`` of the ``json`` object, ``/items/0`` an array's first element);
- ``op`` is one of ``eq``, ``ne``, ``gt``, ``ge``, ``lt``, ``le``, ``in``, ``exists``,
  ``type``;
- ``eq``/``ne`` compare JSON values (numbers by value: ``1`` equals ``1.0``);
  ``gt``/``ge``/``lt``/``le`` compare numbers; ``in`` holds when the value
  equals one of a list; ``exists`` when the pointer resolves (to anything, JSON
  ``null`` included); ``type`` when the value is of the JSON type named
  (``number``, ``string``, ``boolean``, ``null``, ``array``, ``object``);
- where a number is wanted, a string that reads as a JSON number (``"50000"``,
  ``"12.50"``) compares as that number;
- a gate fails closed: a condition that meets a value it cannot judge (``gt``
  meeting ``[50000]`` or ``"lots"``, ``eq "USD"`` meeting a list, ``type
  number`` meeting ``"50000"``) holds the intent whatever the other conditions
  say, and the effect's ``approval`` records why (``reason``); JSON ``null``
  among ``eq``/``ne``/``in``'s values makes every type comparable;
- a condition about a pointer that does not resolve does not hold (``ne`` too);
- a gate holds when all its conditions hold (none: every intent of the kind).

So ``type`` is the strict form: ``[{/json/amount type number}, {/json/amount gt
10000}]`` holds an amount above 10000 and any amount that is not a JSON number.

Gates come from the deliverers config (``[[approvals]]`` tables, read with the
rest of it by :mod:`outbox.delivery.config`, stored in PostgreSQL by ``outbox
gates apply`` and at ``outbox deliver`` start-up) or from
the intent itself (``tx.intend(..., approval=...)``). When both apply, the
config's gate is the one recorded: an intent can add a gate, never loosen one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from outbox.governance.intent_rules import KIND_PATTERN, MAX_DELAY_SECONDS, identifier_violation

__all__ = [
    "JSON_TYPES",
    "OPS",
    "ApprovalPolicy",
    "Condition",
    "Gate",
    "OnTimeout",
    "parse_duration",
    "parse_pointer",
    "policy_json",
]

#: The comparison operators of a condition.
OPS = ("eq", "ne", "gt", "ge", "lt", "le", "in", "exists", "type")
Op = Literal["eq", "ne", "gt", "ge", "lt", "le", "in", "exists", "type"]
#: The JSON types a ``type`` condition names (PostgreSQL's ``jsonb_typeof``).
JSON_TYPES = ("number", "string", "boolean", "null", "array", "object")
_ORDERED = frozenset({"gt", "ge", "lt", "le"})
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


class OnTimeout(StrEnum):
    """What happens when a gated effect's deadline passes with no decision."""

    #: the effect is ``rejected`` (a run awaiting it sees :class:`~outbox.EffectRejected`)
    REJECT = "reject"
    #: its run is cancelled (its effects that have not started are cancelled with it)
    CANCEL_RUN = "cancel_run"
    #: it keeps waiting, with no deadline; the escalation is logged (``escalate_to`` is told)
    ESCALATE = "escalate"


def parse_pointer(pointer: str) -> list[str]:
    """The reference tokens of a JSON Pointer (RFC 6901): ``"/a~1b/0"`` -> ``["a/b", "0"]``."""
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise ValueError("a JSON Pointer is empty or starts with '/'")
    tokens = pointer[1:].split("/")
    for token in tokens:
        if re.search(r"~[^01]|~$", token):
            raise ValueError("'~' must be followed by 0 or 1 (RFC 6901)")
    return [t.replace("~1", "/").replace("~0", "~") for t in tokens]


def parse_duration(value: Any) -> float | None:
    """Seconds from a number or a text such as ``"90s"``, ``"15m"``, ``"24h"``, ``"7d"``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError("must be a number of seconds or a text like '24h', not a bool")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError("must be a number of seconds or a text like '90s', '15m', '24h', '7d'")
        return float(match[1]) * _UNITS[match[2]]
    raise ValueError("must be a number of seconds or a text like '24h'")


class Condition(BaseModel):
    """One test on the payload: ``{pointer, op, value}`` (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    #: A JSON Pointer into the payload (``/json/amount``); one that does not resolve
    #: makes the condition false.
    pointer: str = Field(max_length=1000)
    #: ``eq``, ``ne``, ``gt``, ``ge``, ``lt``, ``le`` (on numbers), ``in`` (a list),
    #: ``exists``, ``type`` (a JSON type); a value it cannot judge holds the intent.
    op: Op
    #: What the payload's value is compared with (none for ``exists``, a JSON type
    #: name for ``type``).
    value: Any = None

    @field_validator("pointer")
    @classmethod
    def _pointer(cls, value: str) -> str:
        parse_pointer(value)
        return value

    @model_validator(mode="after")
    def _value_fits_op(self) -> Condition:
        if self.op in _ORDERED and (
            isinstance(self.value, bool) or not isinstance(self.value, int | float)
        ):
            raise ValueError(f"op {self.op!r} compares numbers: value must be a number")
        if self.op == "in" and (not isinstance(self.value, list) or not self.value):
            raise ValueError("op 'in' needs a non-empty list as value")
        if self.op == "exists" and self.value is not None:
            raise ValueError("op 'exists' takes no value")
        if self.op == "type" and self.value not in JSON_TYPES:
            raise ValueError(f"op 'type' names a JSON type: one of {', '.join(JSON_TYPES)}")
        try:
            json.dumps(self.value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"value must be JSON: {exc}") from None
        return self

    @property
    def path(self) -> list[str]:
        """The pointer as a path (PostgreSQL's ``#>`` takes it as it is)."""
        return parse_pointer(self.pointer)

    def stored(self) -> dict[str, Any]:
        """The form PostgreSQL evaluates (``outbox_gate_match``)."""
        return {"pointer": self.pointer, "path": self.path, "op": self.op, "value": self.value}


class ApprovalPolicy(BaseModel):
    """How long an approval may take and what happens then (a gate's, or an intent's own)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    #: seconds from the intent's commit (``None``: no deadline); TOML also takes ``"24h"``
    timeout: float | None = Field(default=None, gt=0, le=MAX_DELAY_SECONDS)
    #: What happens when the deadline passes: ``reject``, ``cancel_run`` or ``escalate``.
    on_timeout: OnTimeout = OnTimeout.REJECT
    #: who is told when the deadline passes (``on_timeout = "escalate"``): logged and recorded
    escalate_to: str | None = Field(default=None, min_length=1, max_length=500)

    @field_validator("timeout", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value)

    @field_validator("escalate_to")
    @classmethod
    def _plain(cls, value: str | None) -> str | None:
        if value is not None and (found := identifier_violation(value, "")) is not None:
            raise ValueError(found.reason)
        return value


class Gate(ApprovalPolicy):
    """A declared gate: intents of ``kind`` whose payload meets ``when`` wait for approval."""

    #: The gate's name (``outbox gates list``, ``remove NAME``); applying a gate of the
    #: same name replaces it.
    name: str = Field(min_length=1, max_length=200, pattern=KIND_PATTERN)
    #: The effect kind whose intents it holds.
    kind: str = Field(min_length=1, max_length=200, pattern=KIND_PATTERN)
    #: Conditions that must all hold (none: every intent of the kind is held).
    when: list[Condition] = Field(default_factory=list, max_length=50)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Gate:
        """A gate as :meth:`row` stored it."""
        return cls(
            name=row["name"],
            kind=row["kind"],
            when=[
                Condition(pointer=c["pointer"], op=c["op"], value=c.get("value"))
                for c in row["conditions"]
            ],
            timeout=row["timeout_seconds"],
            on_timeout=row["on_timeout"],
            escalate_to=row["escalate_to"],
        )

    def row(self) -> dict[str, Any]:
        """The row of ``outbox_gates`` this gate is stored as."""
        return {
            "name": self.name,
            "kind": self.kind,
            "conditions": json.dumps([c.stored() for c in self.when]),
            "timeout_seconds": self.timeout,
            "on_timeout": self.on_timeout.value,
            "escalate_to": self.escalate_to,
        }


def policy_json(policy: ApprovalPolicy, gate: str) -> str:
    """The ``approval`` an effect records: which gate held it, its deadline rule."""
    return json.dumps(
        {
            "gate": gate,
            "timeout": policy.timeout,
            "on_timeout": policy.on_timeout.value,
            "escalate_to": policy.escalate_to,
        },
        separators=(",", ":"),
    )
