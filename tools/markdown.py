"""Markdown from code: tables of pydantic fields, docstring summaries, cells.

The pieces ``tools.reference`` builds its generated blocks from. A
field's meaning is its ``Field(description=...)`` or the ``#:`` comment above
it in the class that declares it.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

__all__ = [
    "cell",
    "field_meaning",
    "fields_table",
    "nested_models",
    "rst_to_markdown",
    "summary",
    "table",
    "type_name",
]


def cell(text: Any) -> str:
    """Text fit for one Markdown table cell (one line, pipes escaped)."""
    value = " ".join(str(text).split())
    return value.replace("|", "\\|")


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def summary(obj: Any) -> str:
    """The first line of an object's own docstring, RST roles turned into Markdown code."""
    doc = obj.__doc__ if isinstance(obj, type) else inspect.getdoc(obj)
    if isinstance(obj, type) and "__doc__" not in vars(obj):
        doc = None
    first = inspect.cleandoc(doc).split("\n\n")[0] if doc else ""
    return rst_to_markdown(" ".join(first.split()))


def rst_to_markdown(text: str) -> str:
    """``code`` and :role:`target` as Markdown code spans."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def type_name(annotation: Any) -> str:
    """A readable type: ``float``, ``str | None``, ``dict[str, Credential]``."""
    if isinstance(annotation, type) and not getattr(annotation, "__args__", None):
        return annotation.__name__
    text = str(annotation).replace("typing.", "")
    return re.sub(r"\b(?:[a-z_][\w]*\.)+([A-Za-z_]\w*)", r"\1", text)


def _comments(cls: type) -> dict[str, str]:
    """``#:`` comments above each field of a class body, joined."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found: dict[str, str] = {}
    pending: list[str] = []
    for raw in textwrap.dedent(source).splitlines()[1:]:
        line = raw.strip()
        if line.startswith("#:"):
            pending.append(line[2:].strip())
            continue
        match = re.match(r"^(\w+)\s*:", line)
        if match and pending and raw.startswith("    ") and not raw.startswith("     "):
            found[match.group(1)] = " ".join(pending)
        if not line.startswith("#"):
            pending = []
    return found


def field_meaning(model: type[BaseModel], name: str) -> str:
    """A field's description, or the ``#:`` comment above it (in the class that declares it)."""
    info = model.model_fields[name]
    if info.description:
        return rst_to_markdown(info.description)
    for cls in model.__mro__:
        if name in getattr(cls, "__annotations__", {}):
            comment = _comments(cls).get(name)
            if comment:
                return rst_to_markdown(comment)
    return ""


def _default(info: FieldInfo, toml: bool = False) -> str:
    if info.default_factory is not None:
        try:
            made = info.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "computed"
        return f"`{made!r}`" if made in ([], {}) else "computed"
    if info.default is PydanticUndefined:
        return "required"
    value = info.default
    if toml:  # as the config file spells it; unset keys have no TOML value
        return "unset" if value is None else f"`{json.dumps(value)}`"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _bounds(info: FieldInfo) -> str:
    parts = []
    for item in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                parts.append(f"{sign} {getattr(item, attr)}")
        if getattr(item, "min_length", None) is not None:
            parts.append(f"length ≥ {item.min_length}")
        if getattr(item, "max_length", None) is not None:
            parts.append(f"length ≤ {item.max_length}")
    return ", ".join(parts)


def fields_table(
    model: type[BaseModel],
    names: Iterable[str] | None = None,
    *,
    env: str = "",
    options: dict[str, str] | None = None,
    toml: bool = False,
) -> str:
    """One row per field: name, type, default, bounds, meaning.

    With ``env``, a column of environment variables; with ``options``, a column
    of the command-line options that set a field.
    """
    chosen = list(model.model_fields) if names is None else list(names)
    header = ["field", "type", "default", "bounds", "meaning"]
    if options is not None:
        header.insert(1, "option")
    if env:
        header.insert(1, "variable")
    rows = []
    for name in chosen:
        info = model.model_fields[name]
        row = [
            f"`{name}`",
            f"`{type_name(info.annotation)}`",
            _default(info, toml),
            _bounds(info),
            field_meaning(model, name),
        ]
        if options is not None:
            row.insert(1, f"`{options[name]}`" if name in options else "")
        if env:
            row.insert(1, f"`{env}{name.upper()}`")
        rows.append(row)
    return table(header, rows)


def nested_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """Models a field of ``model`` holds (a credential table, say), in field order."""
    found: list[type[BaseModel]] = []

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation not in found:
                found.append(annotation)
            return
        for arg in getattr(annotation, "__args__", ()):
            visit(arg)

    for info in model.model_fields.values():
        visit(info.annotation)
    return found
