"""Boundary validation helpers: pydantic errors become ours, naming the field and the value."""

from __future__ import annotations

import uuid
from typing import Any

import pydantic

from outbox.errors import ValidationError

__all__ = ["as_uuid", "validated"]


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
