"""The command-line reference: every command, argument and option, as Markdown."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Any

import click

from outbox.cli import commands
from tools.markdown import rst_to_markdown, table

__all__ = ["cli_block", "command_heading"]


def _unset(value: Any) -> bool:
    return value is None or repr(value) == "Sentinel.UNSET" or value == ()


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _param_type(param: click.Parameter) -> str:
    kind = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    if isinstance(kind, click.Choice):
        return " | ".join(str(c) for c in kind.choices)
    if isinstance(kind, click.IntRange | click.FloatRange):
        base = "integer" if isinstance(kind, click.IntRange) else "number"
        low = "" if kind.min is None else f"{_number(kind.min)} ≤ "
        high = "" if kind.max is None else f" ≤ {_number(kind.max)}"
        return f"{base} ({low}x{high})" if low or high else base
    names = {"text": "text", "integer": "integer", "float": "number", "uuid": "UUID"}
    name = kind.name.lower()
    return names.get(name, "path" if "path" in name else name)


def _param_default(param: click.Parameter, help_text: str) -> tuple[str, str]:
    """The default shown, and the help without a ``[default: X]`` the help carried."""
    match = re.search(r"\s*\[default: ([^\]]+)\]", help_text)
    if match:
        return f"`{match.group(1)}`", help_text.replace(match.group(0), "")
    default = param.default
    if _unset(default) or (isinstance(param, click.Option) and param.is_flag and not default):
        return "", help_text
    if isinstance(param, click.Option) and param.is_flag and param.secondary_opts:
        return f"`{param.opts[0] if default else param.secondary_opts[0]}`", help_text
    return f"`{default}`", help_text


def _help_body(command: click.Command) -> str:
    text = inspect.cleandoc(command.help or "")
    parts = []
    for paragraph in text.split("\n\n"):
        if paragraph.startswith("\b"):
            body = paragraph[1:].strip("\n")
            parts.append("```text\n" + body + "\n```")
        else:
            parts.append(rst_to_markdown(" ".join(paragraph.split())))
    return "\n\n".join(p for p in parts if p.strip())


def command_heading(path: Sequence[str]) -> str:
    """The heading of a command's section: ``outbox runs show``."""
    return " ".join(("outbox", *path))


def cli_block() -> str:
    """Each command: usage, help, and a table of its arguments and options."""
    parts = []
    for path, command in commands():
        ctx = click.Context(command, info_name=command_heading(path))
        usage = " ".join([command_heading(path), *command.collect_usage_pieces(ctx)])
        parts.append(f"### `{command_heading(path)}`\n")
        parts.append(f"```text\n{usage}\n```\n")
        body = _help_body(command)
        if body:
            parts.append(body + "\n")
        rows = []
        for param in command.params:
            if isinstance(param, click.Argument):
                need = "required" if param.required else "optional"
                if param.nargs == -1:
                    need += ", any number"
                rows.append([f"`{param.human_readable_name}`", "argument", "", "", need])
                continue
            if not isinstance(param, click.Option) or param.hidden:
                continue
            names = " / ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
            default, help_text = _param_default(param, param.help or "")
            notes = rst_to_markdown(help_text.strip())
            if param.required:
                notes = ("required. " + notes).strip()
            if param.multiple and "repeatable" not in notes.lower():
                notes = (notes + " Repeatable.").strip()
            envvar = param.envvar if isinstance(param.envvar, str) else ""
            rows.append(
                [names, _param_type(param), default, f"`{envvar}`" if envvar else "", notes]
            )
        if rows:
            parts.append(table(["option", "takes", "default", "variable", "meaning"], rows))
        if isinstance(command, click.Group) and path:
            subs = ", ".join(
                f"[`{name}`](#{_anchor(command_heading((*path, name)))})"
                for name in sorted(command.commands)
            )
            parts.append(f"\nSub-commands: {subs}.")
        parts.append("")
    return "\n".join(parts).rstrip()


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
