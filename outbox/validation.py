"""Boundary validation helpers: pydantic errors become ours, naming the field and the value."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Callable
from typing import Any

import pydantic

from outbox.errors import ConfigurationError, ValidationError

__all__ = ["as_uuid", "import_callable", "validated"]


def validated(model: type[pydantic.BaseModel], **values: Any) -> Any:
    """Validate boundary input, turning pydantic's error into ours (field and value named)."""
    try:
        return model(**values)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or model.__name__
        raise ValidationError(field, first.get("input"), first["msg"]) from None


def as_uuid(value: uuid.UUID | str, field: str) -> uuid.UUID:
    """Parse an id given as text, or refuse it naming ``field``."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise ValidationError(field, value, "not a UUID") from None


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
