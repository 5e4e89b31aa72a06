"""Boundary validation helpers: pydantic errors become ours, naming the field and the value."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable
from typing import Any

import pydantic

from outbox.errors import ConfigurationError, ValidationError
from outbox.intent_rules import REASONS, check_identifier

__all__ = ["as_uuid", "import_callable", "name_field", "row_limit", "rule_of", "validated"]

#: The most rows a listing returns at once.
MAX_ROW_LIMIT = 1_000_000


def validated(model: type[pydantic.BaseModel], **values: Any) -> Any:
    """Validate boundary input, turning pydantic's error into ours (field and value named)."""
    try:
        return model(**values)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or model.__name__
        rule = rule_of(first)
        reason = REASONS[rule] if rule else first["msg"].removeprefix("Value error, ")
        raise ValidationError(field, first.get("input"), reason, rule=rule) from None


#: pydantic's own refusal of a text (a strict ``str`` field) that is one of our rules.
_PYDANTIC_RULES = {"string_unicode": "surrogate"}


def rule_of(error: Any) -> str | None:
    """The intent rule a pydantic error reports (its type is the rule's code), if any."""
    kind = _PYDANTIC_RULES.get(error.get("type"), error.get("type"))
    return kind if kind in REASONS else None


def as_uuid(value: uuid.UUID | str, field: str) -> uuid.UUID:
    """Parse an id given as text, or refuse it naming ``field``."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ValidationError(field, value, "not a UUID") from None


def name_field(value: Any, field: str, *, max_length: int = 200) -> str:
    """A non-empty name of at most ``max_length`` characters with no control character."""
    if not isinstance(value, str):
        raise ValidationError(field, value, "must be a string")
    if not value.strip():
        raise ValidationError(field, value, "must not be empty")
    if len(value) > max_length:
        raise ValidationError(field, value, f"is {len(value)} characters, over {max_length}")
    return check_identifier(value, field)


def row_limit(value: Any, field: str = "limit") -> int:
    """How many rows a listing may return: an integer from 0 to :data:`MAX_ROW_LIMIT`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_ROW_LIMIT:
        raise ValidationError(field, value, f"must be an integer from 0 to {MAX_ROW_LIMIT}")
    return value


def import_callable(path: str, *, field: str = "function") -> Callable[..., Any]:
    """Import ``package.module:attr`` named by configuration or a command line, never a payload."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"{field}={path!r}: expected 'package.module:attr'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"{field}={path!r}: {exc}") from exc
    if not callable(target):
        raise ConfigurationError(f"{field}={path!r} is not callable")
    return target  # type: ignore[no-any-return]
