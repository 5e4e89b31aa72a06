"""What the HTTP API accepts and answers: one pydantic model per body, query and response.

The request models reuse the client's own boundary models (``RunStart``,
``EffectIntent``), so a field is refused by the same rule whether it comes from
Python or over HTTP. Fields the client checks itself (a step id, a debit, a
signal's name) are only typed here: the client's checks (``outbox.governance.intent_rules``,
``outbox.validation``, its settings) refuse them, so there is one implementation
of every rule, and the SQL API is held to the same cases. The OpenAPI document
(``schemas/http-api.openapi.json``) is generated from these models
(:mod:`outbox.serve.api.openapi`).
"""

from __future__ import annotations

from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from outbox.models import (
    Effect,
    EffectAttempt,
    EffectIntent,
    EffectStatus,
    RunRecord,
    RunStart,
    RunStatus,
    StepRecord,
)

__all__ = [
    "ERROR_CODES",
    "MAX_LIST_LIMIT",
    "ApiError",
    "CompleteRequest",
    "EffectList",
    "EffectOutcome",
    "EffectQuery",
    "EffectView",
    "FailRequest",
    "RunAnswer",
    "RunList",
    "RunQuery",
    "RunView",
    "SignalReceipt",
    "SignalRequest",
    "Spend",
    "StartRunRequest",
    "StepRecorded",
    "StepRequest",
    "WaitQuery",
]

#: The most rows one listing returns.
MAX_LIST_LIMIT = 1000

_BODY = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# -- requests ------------------------------------------------------------------------


class StartRunRequest(RunStart):
    """``POST /api/v1/runs``: start a run of ``agent`` pinned to ``version``.

    Pass your own ``run_id`` (a UUID you generate) to make the call safe to
    retry: the same id with the same agent, version, inputs and budget answers
    200 with the run; with anything else it is a 409 naming the field.
    """

    run_id: UUID | None = Field(
        default=None, description="Your id for the run: makes the call safe to retry."
    )


class Spend(BaseModel):
    """A budget debit of the step (``tx.spend``): keyed by (run, step, reason), so never twice."""

    model_config = _BODY

    amount: float = Field(description="A positive amount of at most 1e15.")
    reason: str = Field(description="What the debit is for; once per step.")


class StepRequest(BaseModel):
    """``POST /api/v1/runs/{run_id}/steps``: record one step atomically.

    The step's result, the run's new state and plan, its budget debits and its
    intents commit in one transaction or not at all (G1). A step id is
    recorded once: sending it again returns the recorded step (200,
    ``replayed``) and writes nothing, whatever the rest of the body says (G5).
    ``state`` and ``plan`` left out keep the run's; sent as ``null`` they set null.
    """

    model_config = _BODY

    step_id: str = Field(
        description="Names the step within its run, once: the step's idempotency key "
        "(not empty, no control character, at most the server's max_step_id_length, 200 "
        "by default).",
    )
    result: Any = Field(default=None, description="What a replay of this step returns.")
    state: Any = Field(default=None, description="The run's new state (left out: unchanged).")
    plan: Any = Field(default=None, description="The run's new plan (left out: unchanged).")
    intents: list[EffectIntent] = Field(
        default_factory=list,
        description="Effects to perform once this step commits, in order. The key of "
        "each defaults to one derived from (run, step, index).",
    )
    spend: list[Spend] = Field(default_factory=list)


class SignalRequest(BaseModel):
    """``POST /api/v1/runs/{run_id}/signals``: send signal ``name`` to a run."""

    model_config = _BODY

    name: str = Field(description="The signal's name: not empty, no control character.")
    payload: Any = None
    dedup_key: str | None = Field(
        default=None,
        description="The same key is accepted once (a retry is answered duplicate).",
    )


class CompleteRequest(BaseModel):
    """``POST /api/v1/runs/{run_id}/complete``: end the run as completed."""

    model_config = _BODY

    result: Any = None


class FailRequest(BaseModel):
    """``POST /api/v1/runs/{run_id}/fail``: end the run as failed, saying why."""

    model_config = _BODY

    error: Any


class RunQuery(BaseModel):
    """Filters of ``GET /api/v1/runs`` (newest first)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    status: RunStatus | None = None
    agent: str | None = None
    limit: int = Field(default=100, ge=1, le=MAX_LIST_LIMIT)


class EffectQuery(BaseModel):
    """Filters of ``GET /api/v1/effects`` (intent order); ``step_id`` needs ``run_id``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: UUID | None = None
    step_id: str | None = None
    status: EffectStatus | None = None
    kind: str | None = None
    limit: int = Field(default=100, ge=1, le=MAX_LIST_LIMIT)


class WaitQuery(BaseModel):
    """``GET /api/v1/effects/{effect_id}/outcome?wait=S``: how long to wait for the end."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    wait: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="Seconds to wait for the effect to end (0: answer at once). The "
        "server waits at most its --max-wait (60 s by default).",
    )


# -- responses -----------------------------------------------------------------------


class RunAnswer(BaseModel):
    """The run after a start, complete or fail.

    ``replayed`` is true when the call changed nothing because it had been made
    before (a retried start with the same ``run_id``, a second complete).
    """

    run: RunRecord
    replayed: bool


class RunView(BaseModel):
    """A run and its completed steps, in the order they were recorded."""

    run: RunRecord
    steps: list[StepRecord]


class RunList(BaseModel):
    """Runs, newest first."""

    runs: list[RunRecord]


class StepRecorded(BaseModel):
    """The recorded step and its effects.

    ``replayed`` is false when this request recorded the step (201) and true
    when it was recorded before, by this or another request (200): then nothing
    was written, and ``step.result`` and ``effects`` are the recorded ones.
    """

    step: StepRecord
    replayed: bool
    effects: list[Effect]


class SignalReceipt(BaseModel):
    """A stored signal (``duplicate``: its dedup key was seen before, nothing stored)."""

    signal_id: UUID | None
    duplicate: bool
    woke_run: bool


class EffectList(BaseModel):
    """Effects in intent order."""

    effects: list[Effect]


class EffectView(BaseModel):
    """One effect and its attempt log, oldest first."""

    effect: Effect
    attempts: list[EffectAttempt]


class EffectOutcome(BaseModel):
    """Where an awaited effect is.

    ``done`` is true once the effect can no longer change by delivery
    (succeeded, failed, cancelled, compensated, rejected); false when the wait ran out
    first (ask again). ``result`` is what the sink answered (succeeded), and
    ``error`` why it did not succeed.
    """

    done: bool
    status: EffectStatus
    result: Any = None
    error: str | None = None
    effect: Effect


#: Every error code of the API, with its status and meaning (the docs and the
#: OpenAPI document list these).
ERROR_CODES: dict[str, tuple[int, str]] = {
    "malformed": (400, "the body is not a JSON object (or nests deeper than 64 levels)"),
    "unauthenticated": (401, "no or a wrong `Authorization: Bearer <OUTBOX_API_TOKEN>`"),
    "not_found": (404, "no such route"),
    "run_not_found": (404, "no run has this id"),
    "effect_not_found": (404, "no effect has this id"),
    "method_not_allowed": (405, "the route does not take this method"),
    "body_timeout": (408, "the body did not arrive within --body-timeout"),
    "idempotency_conflict": (
        409,
        "an intent's key is held by an intent of another kind, payload or run "
        "(`field` names the intent, `key` the key)",
    ),
    "run_conflict": (
        409,
        "a run with this run_id exists with another agent, version, inputs, budget or mode "
        "(`field` names the first that differs)",
    ),
    "run_terminal": (409, "the run has ended: it takes no more steps or signals"),
    "run_state": (409, "the run cannot take this action now"),
    "budget_exceeded": (409, "the step would spend more than the run's remaining budget"),
    "body_too_large": (413, "the body is over --max-body-bytes"),
    "unsupported_media_type": (415, "a body must be sent as Content-Type: application/json"),
    "misdirected": (421, "the Host header names a host this server does not answer to"),
    "invalid": (422, "a field is missing or not acceptable (`field` names it)"),
    "internal": (500, "the server failed; the request may be sent again"),
    "api_disabled": (503, "the server has no OUTBOX_API_TOKEN: the API is off"),
    "database_unavailable": (503, "the database did not answer; send the request again"),
    "too_many_waiters": (503, "too many long polls at once; wait Retry-After seconds"),
    "busy": (503, "--max-concurrency requests are in progress; wait Retry-After seconds"),
}

ErrorCode = Literal[
    "malformed",
    "unauthenticated",
    "not_found",
    "run_not_found",
    "effect_not_found",
    "method_not_allowed",
    "body_timeout",
    "idempotency_conflict",
    "run_conflict",
    "run_terminal",
    "run_state",
    "budget_exceeded",
    "body_too_large",
    "unsupported_media_type",
    "misdirected",
    "invalid",
    "internal",
    "api_disabled",
    "database_unavailable",
    "too_many_waiters",
    "busy",
]


class ApiError(BaseModel):
    """Every refusal: a message for people, a stable ``code`` for programs.

    ``field`` names the offending input (``intents[1].payload.headers``) when
    there is one; ``rule`` is the intent rule it breaks (the codes of
    ``outbox.governance.intent_rules``, the same the SQL API reports); ``key`` is the
    idempotency key of a conflict.
    """

    error: str
    code: ErrorCode
    field: str | None = None
    rule: str | None = None
    key: str | None = None
