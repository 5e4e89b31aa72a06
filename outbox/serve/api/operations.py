"""Every route of the HTTP API as data: method, path, models, answers.

The router (:func:`outbox.serve.api.api_app`) and the OpenAPI document
(:mod:`outbox.serve.api.openapi`) are both built from :data:`OPERATIONS`, so
a route cannot exist without being described, nor be described differently
from what it takes and answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from outbox.serve.api import models

__all__ = ["API_PREFIX", "OPENAPI_PATH", "OPERATIONS", "Operation"]

#: Where the API is mounted in ``outbox serve``.
API_PREFIX = "/api/v1"
#: The OpenAPI document, served without a token (it holds nothing secret).
OPENAPI_PATH = "/openapi.json"


@dataclass(frozen=True)
class Operation:
    """One route: ``handler`` names the method of ``ApiHandlers`` that serves it.

    ``answers`` maps each success status to its model; ``refusals`` lists the
    error codes (:data:`~outbox.serve.api.models.ERROR_CODES`) it may answer
    besides those every route may (auth, limits, database).
    """

    method: str
    path: str
    handler: str
    summary: str
    description: str
    answers: dict[int, type[BaseModel]]
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    refusals: tuple[str, ...] = field(default=())

    @property
    def path_params(self) -> list[str]:
        """Names in ``{braces}`` in the path, in order."""
        return [part[1:-1] for part in self.path.split("/") if part.startswith("{")]


#: What every authenticated route may answer, besides its own refusals.
COMMON_REFUSALS = (
    "misdirected",
    "unauthenticated",
    "body_too_large",
    "body_timeout",
    "internal",
    "api_disabled",
    "database_unavailable",
    "busy",
)
_BODY_REFUSALS = ("malformed", "unsupported_media_type", "invalid")

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "POST",
        "/runs",
        "start_run",
        "Start a run",
        "Starts a run of `agent` pinned to `version` with immutable `inputs`. "
        "Send your own `run_id` to make the call safe to retry: the same id and "
        "arguments answer 200 with `replayed: true`; another agent, version, inputs, "
        "budget or mode under that id is a 409 `run_conflict` naming the field. `mode: "
        "dry_run` starts a dry run: its intents go to recording stubs, never to a sink.",
        {201: models.RunAnswer, 200: models.RunAnswer},
        body=models.StartRunRequest,
        refusals=(*_BODY_REFUSALS, "run_conflict"),
    ),
    Operation(
        "GET",
        "/runs",
        "list_runs",
        "List runs",
        "Runs, newest first, filtered by status and agent.",
        {200: models.RunList},
        query=models.RunQuery,
        refusals=("invalid",),
    ),
    Operation(
        "GET",
        "/runs/{run_id}",
        "get_run",
        "Read a run",
        "The run (status, state, plan, budget) and its completed steps.",
        {200: models.RunView},
        refusals=("invalid", "run_not_found"),
    ),
    Operation(
        "POST",
        "/runs/{run_id}/steps",
        "record_step",
        "Record a step",
        "Records one step atomically, as `Run.transaction` does: its result, the "
        "run's new state and plan, its budget debits and its intents commit "
        "together or not at all. The step id is recorded once: sending it again "
        "answers 200 with the recorded step and effects (`replayed: true`) and "
        "writes nothing. An intent's own `key` already held by an intent of "
        "another kind, payload or run is a 409 `idempotency_conflict` naming the "
        "intent (`field`) and the key; nothing of the step is written.",
        {201: models.StepRecorded, 200: models.StepRecorded},
        body=models.StepRequest,
        refusals=(
            *_BODY_REFUSALS,
            "run_not_found",
            "idempotency_conflict",
            "run_terminal",
            "run_state",
            "budget_exceeded",
        ),
    ),
    Operation(
        "POST",
        "/runs/{run_id}/signals",
        "send_signal",
        "Send a signal",
        "Sends signal `name` with a JSON `payload` to a run (an approval, an "
        "event). A run waiting for it is woken; one that has not reached its wait "
        "finds it there. The same `dedup_key` is accepted once (`duplicate: true`).",
        {202: models.SignalReceipt},
        body=models.SignalRequest,
        refusals=(*_BODY_REFUSALS, "run_not_found", "run_terminal"),
    ),
    Operation(
        "POST",
        "/runs/{run_id}/complete",
        "complete_run",
        "Complete a run",
        "Ends the run as `completed` with an optional result. Completing a run "
        "that is completed already answers 200 `replayed: true` (the first result stays).",
        {200: models.RunAnswer},
        body=models.CompleteRequest,
        refusals=(*_BODY_REFUSALS, "run_not_found", "run_terminal", "run_state"),
    ),
    Operation(
        "POST",
        "/runs/{run_id}/fail",
        "fail_run",
        "Fail a run",
        "Ends the run as `failed`, recording why. Failing a run that failed "
        "already answers 200 `replayed: true` (the first error stays).",
        {200: models.RunAnswer},
        body=models.FailRequest,
        refusals=(*_BODY_REFUSALS, "run_not_found", "run_terminal", "run_state"),
    ),
    Operation(
        "GET",
        "/effects",
        "list_effects",
        "List effects",
        "Effects in intent order, filtered by run (and step of that run), status and kind.",
        {200: models.EffectList},
        query=models.EffectQuery,
        refusals=("invalid",),
    ),
    Operation(
        "GET",
        "/effects/{effect_id}",
        "get_effect",
        "Read an effect",
        "One effect (its delivery state, result and last error) and its attempt log.",
        {200: models.EffectView},
        refusals=("invalid", "effect_not_found"),
    ),
    Operation(
        "GET",
        "/effects/{effect_id}/outcome",
        "await_effect",
        "Await an effect's outcome (long poll)",
        "Answers as soon as the effect has ended (succeeded, failed, cancelled, "
        "compensated or rejected: `done: true`), or when `wait` seconds have passed "
        "(`done: false`: ask again). Waiting writes nothing, so a client that "
        "goes away leaves nothing behind. `unknown` and `awaiting_approval` are not "
        "ends: a person decides them.",
        {200: models.EffectOutcome},
        query=models.WaitQuery,
        refusals=("invalid", "effect_not_found", "too_many_waiters"),
    ),
)
