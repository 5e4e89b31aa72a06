"""Boundary validation helpers: pydantic errors become ours, naming the field and the value."""

from __future__ import annotations

import difflib
import importlib
import types
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, Union, get_args, get_origin

import pydantic

from outbox.errors import ConfigurationError, ValidationError
from outbox.governance.intent_rules import REASONS, check_identifier

__all__ = [
    "as_uuid",
    "config_error",
    "did_you_mean",
    "import_callable",
    "name_field",
    "row_limit",
    "rule_of",
    "validated",
    "validated_table",
]

M = TypeVar("M", bound=pydantic.BaseModel)

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


def did_you_mean(name: str, known: Sequence[str]) -> str:
    """A hint for a name that is not one of ``known``: the closest, or the list of them."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"known: {', '.join(sorted(known))}" if known else "none is known here"


def config_error(
    prefix: str, exc: pydantic.ValidationError, model: type[Any]
) -> ConfigurationError:
    """A refusal of a config table by pydantic as one line: ``PREFIX FIELD=VALUE: REASON``.

    ``prefix`` locates the table (``"dry_run."``, ``"approvals[0]."``,
    ``"deliverer 'email.send': "``). A key the model does not have is named with
    a "did you mean" hint drawn from the keys allowed at that level of
    ``model``, however deep it sits.
    """
    errors = exc.errors()
    # A misspelt key also makes the key it meant missing: name the misspelling.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    field = ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in first["loc"])
    path = (prefix + field.replace(".[", "[")).rstrip(". :") or model.__name__
    if first["type"] == "extra_forbidden":
        known = _keys_at(model, first["loc"][:-1])
        hint = did_you_mean(str(first["loc"][-1]), known)
        return ConfigurationError(f"{path}: unknown key ({hint})")
    reason = first["msg"].removeprefix("Value error, ")
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ConfigurationError(f"{path}={shown}: {reason}")


def validated_table(model: type[M], raw: Any, prefix: str, not_a_table: str) -> M:
    """A config table validated by ``model``; a refusal is :func:`config_error`'s one line.

    ``raw`` that is not a table at all is refused with ``not_a_table`` (the
    message names where in the file it sits and how it should be written).
    """
    if not isinstance(raw, Mapping):
        raise ConfigurationError(not_a_table)
    try:
        return model.model_validate(dict(raw))
    except pydantic.ValidationError as exc:
        raise config_error(prefix, exc, model) from None


def _keys_at(model: type[Any], loc: Sequence[Any]) -> list[str]:
    """The keys a table at ``loc`` inside ``model`` may have (empty when it cannot tell)."""
    current: Any = model
    for step in loc:
        current = _step(current, step)
        if current is None:
            return []
    found = _model_in(current)
    return list(found.model_fields) if found is not None else []


def _model_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        for arg in get_args(annotation):
            if (found := _model_in(arg)) is not None:
                return found
    return None


def _step(annotation: Any, step: Any) -> Any:
    model = _model_in(annotation)
    if model is not None:
        field = model.model_fields.get(str(step))
        return field.annotation if field is not None else None
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (list, tuple, set, frozenset) and args and isinstance(step, int):
        return args[0]
    if origin is dict and len(args) == 2:
        return args[1]
    return None
