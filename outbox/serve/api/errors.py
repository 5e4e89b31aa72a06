"""How the HTTP API refuses: one JSON shape, a stable code, the field named.

:class:`ApiRefusal` is raised anywhere in a request's handling (parsing, inside
a step's transaction, which then rolls back whole) and becomes the answer.
:func:`refusal_of` maps the client's typed errors onto codes, so the rules and
their wording stay the client's. The parsers here read what a request carries
(JSON body, query string, path) into the models of :mod:`outbox.serve.api.models`.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, TypeVar

import pydantic
from starlette.requests import Request
from starlette.responses import JSONResponse

from outbox.errors import (
    BudgetExceeded,
    DatabaseError,
    EffectNotFound,
    IdempotencyConflict,
    OutboxError,
    RunNotFound,
    RunStateError,
    RunTerminal,
    ValidationError,
)
from outbox.governance.intent_rules import REASONS
from outbox.serve.api.models import ERROR_CODES, ApiError
from outbox.serve.transport import BODY_KEY
from outbox.serve.webhooks import MAX_DEPTH, too_deep
from outbox.validation import rule_of

__all__ = [
    "ApiRefusal",
    "error_response",
    "parse_body",
    "parse_query",
    "path_uuid",
    "refusal_of",
    "within",
]

log = logging.getLogger("outbox.serve")

M = TypeVar("M", bound=pydantic.BaseModel)

#: Longest message text sent back (a value quoted in it is shortened already).
_MAX_MESSAGE = 1000


def error_response(
    code: str,
    message: str,
    *,
    field: str | None = None,
    rule: str | None = None,
    key: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The JSON answer of a refusal (status from :data:`ERROR_CODES`)."""
    body = ApiError(error=message[:_MAX_MESSAGE], code=code, field=field, rule=rule, key=key)
    return JSONResponse(
        body.model_dump(mode="json", exclude_none=True),
        status_code=ERROR_CODES[code][0],
        headers=headers,
    )


class ApiRefusal(Exception):
    """A request refused with ``code`` (see :data:`ERROR_CODES`), naming ``field`` or ``key``."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        field: str | None = None,
        rule: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        assert code in ERROR_CODES, code
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.rule = rule
        self.key = key
        self.headers = headers

    @property
    def status(self) -> int:
        """The HTTP status this refusal is answered with."""
        return ERROR_CODES[self.code][0]

    def response(self) -> JSONResponse:
        """The answer."""
        return error_response(
            self.code,
            self.message,
            field=self.field,
            rule=self.rule,
            key=self.key,
            headers=self.headers,
        )


def refusal_of(exc: OutboxError) -> ApiRefusal:
    """The answer to one of the client's errors."""
    if isinstance(exc, ValidationError):  # PayloadError included
        return ApiRefusal("invalid", str(exc), field=exc.field, rule=exc.rule)
    if isinstance(exc, IdempotencyConflict):
        return ApiRefusal("idempotency_conflict", str(exc), key=exc.key)
    if isinstance(exc, RunNotFound):
        return ApiRefusal("run_not_found", str(exc), field="run_id")
    if isinstance(exc, EffectNotFound):
        return ApiRefusal("effect_not_found", str(exc), field="effect_id")
    if isinstance(exc, RunTerminal):
        return ApiRefusal("run_terminal", str(exc), field="run_id")
    if isinstance(exc, RunStateError):
        return ApiRefusal("run_state", str(exc), field="run_id")
    if isinstance(exc, BudgetExceeded):
        return ApiRefusal("budget_exceeded", str(exc), field="spend")
    if isinstance(exc, DatabaseError) and exc.transient:
        log.warning("api: the database did not answer: %s", exc)
        return ApiRefusal("database_unavailable", "the database did not answer; send it again")
    # The driver's text can name hosts and users: it goes to the log, not to the caller.
    log.error("api: %s: %s", type(exc).__name__, exc)
    return ApiRefusal("internal", "the request failed; send it again")


def within(prefix: str, exc: OutboxError) -> Exception:
    """``exc`` about a part of the request (``intents[2]``): its field named from the top."""
    if isinstance(exc, ValidationError):
        field = exc.field if exc.field.startswith(prefix.split("[")[0]) else f"{prefix}.{exc.field}"
        return ApiRefusal("invalid", f"{field}={_after_field(exc)}", field=field, rule=exc.rule)
    if isinstance(exc, IdempotencyConflict):
        return ApiRefusal("idempotency_conflict", str(exc), field=f"{prefix}.key", key=exc.key)
    return exc


def _after_field(exc: ValidationError) -> str:
    # The client's message is "field=value: reason", its value shortened already.
    return str(exc).removeprefix(f"{exc.field}=")


# -- reading requests ----------------------------------------------------------------


def _loc(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _invalid(exc: pydantic.ValidationError, prefix: str = "") -> ApiRefusal:
    first = exc.errors()[0]
    field = _loc((*((prefix,) if prefix else ()), *first["loc"])) or "body"
    rule = rule_of(first)
    reason = REASONS[rule] if rule else first["msg"].removeprefix("Value error, ")
    return ApiRefusal("invalid", f"{field}: {reason}", field=field, rule=rule)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (non-finite numbers are refused)")


def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``; refused as malformed (400) or invalid (422)."""
    body: bytes = request.scope.get(BODY_KEY, b"")
    media = request.headers.get("content-type")
    if body and media is not None:
        kind = media.split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            raise ApiRefusal(
                "unsupported_media_type",
                f"Content-Type {kind[:100]!r}: send the body as application/json",
            )
    if too_deep(body):
        raise ApiRefusal("malformed", f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        data = json.loads(body or b"{}", parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiRefusal("malformed", f"not JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiRefusal("malformed", "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        raise _invalid(exc) from None


def parse_query(request: Request, model: type[M]) -> M:
    """The query string as ``model`` (each parameter at most once); invalid ones are a 422."""
    values: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name in values:
            raise ApiRefusal("invalid", f"{name}: given more than once", field=name)
        values[name] = value
    try:
        return model.model_validate(values)
    except pydantic.ValidationError as exc:
        raise _invalid(exc) from None


def path_uuid(request: Request, name: str) -> uuid.UUID:
    """A path parameter that must be a UUID; else a 422 naming it."""
    value = str(request.path_params[name])
    try:
        return uuid.UUID(value)
    except ValueError:
        raise ApiRefusal("invalid", f"{name}={value[:80]!r}: not a UUID", field=name) from None
