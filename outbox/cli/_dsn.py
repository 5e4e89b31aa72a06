"""Where the CLI's DSN comes from: ``--dsn``, ``--dsn-file``, ``OUTBOX_DSN``, ``OUTBOX_DSN_FILE``.

A password given with ``--dsn`` is visible to every local user in the process
list (``ps``, ``/proc/<pid>/cmdline``): it still works, with a one-line warning
on stderr. The environment (readable only by the same user) or a file does not
show it.
"""

from __future__ import annotations

import re
import stat
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import click
from click.core import ParameterSource

__all__ = ["choose_dsn", "dsn_has_password"]

_KEYWORD_PASSWORD = re.compile(r"(?:^|\s)password\s*=", re.IGNORECASE)


def dsn_has_password(dsn: str) -> bool:
    """Whether a URL or keyword/value DSN carries a password."""
    if "://" not in dsn:
        return _KEYWORD_PASSWORD.search(dsn) is not None
    try:
        parts = urlsplit(dsn)
        return bool(parts.password) or "password" in parse_qs(parts.query)
    except ValueError:
        return False


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
        mode = stat.S_IMODE(path.stat().st_mode)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise click.BadParameter(f"{path}: {reason}", param_hint="--dsn-file") from exc
    if not text:
        raise click.BadParameter(f"{path} is empty", param_hint="--dsn-file")
    if mode & 0o077 and dsn_has_password(text):
        click.echo(
            f"warning: {path} holds a password and is readable by other users "
            f"(mode {mode:04o}); chmod 600 it",
            err=True,
        )
    return text


def choose_dsn(ctx: click.Context, dsn: str | None, dsn_file: Path | None) -> str | None:
    """The DSN to use: the command line beats the environment; two at one level are refused."""
    dsn_source = ctx.get_parameter_source("dsn")
    file_source = ctx.get_parameter_source("dsn_file")
    if dsn is not None and dsn_file is not None:
        if dsn_source == file_source:
            where = "options" if dsn_source == ParameterSource.COMMANDLINE else "variables"
            names = (
                "--dsn and --dsn-file" if where == "options" else "OUTBOX_DSN and OUTBOX_DSN_FILE"
            )
            raise click.UsageError(f"{names} are both given: keep one")
        if dsn_source == ParameterSource.COMMANDLINE:
            dsn_file = None
        else:
            dsn = None
    if dsn_file is not None:
        return _read(dsn_file)
    if dsn is not None and dsn_source == ParameterSource.COMMANDLINE and dsn_has_password(dsn):
        click.echo(
            "warning: --dsn puts its password in the process list, visible to every local "
            "user; use OUTBOX_DSN or --dsn-file instead",
            err=True,
        )
    return dsn
