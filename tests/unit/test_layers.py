"""Imports run one way: cli → client → delivery → runs → storage → base modules.

Walks the AST of every module (module-level, function-local and
``TYPE_CHECKING`` imports alike) and checks the contracts of the layout.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import parse_python

ROOT = Path(__file__).resolve().parents[2]

# Lower layers may not import higher ones. Base modules (errors, models, ...)
# sit under storage and import nothing of the layers. ``check`` (the
# crash-consistency kit) composes the client and the deliverers, as the CLI does.
LAYERS = ["storage", "runs", "delivery", "client", "integrations", "serve", "check", "cli"]
# The composition roots: the only packages that import ``deliverers``.
COMPOSERS = (["outbox", "cli"], ["outbox", "check"])
# Modules named otherwise that belong to a layer.
ALIASES = {"async_client": "client", "client_core": "client"}
BASE = {
    "governance",
    "errors",
    "models",
    "settings",
    "retry",
    "payloads",
    "keys",
    "ids",
    "validation",
    "faults",
    "tracing",
    "blobs",
}
# The permitted upward edges: a finished effect moves a stopping run on, and a
# passed approval deadline is acted on (rejected, or its run cancelled).
ALLOWED = {("delivery", "runs.stopping"), ("delivery", "runs.approvals")}


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str = "") -> list[tuple[str, int]]:
    """Every module a file imports (absolute names, relative ones resolved), with the line.

    ``module`` is the package the importing file is in (the package itself
    for an ``__init__``): relative imports are resolved against it.
    """
    return [(name, line) for name, line, _ in _imports(source, module)]


def _imports(source: str, module: str) -> list[tuple[str, int, bool]]:
    """(module, line, at import time): the last is False inside functions and TYPE_CHECKING."""
    tree = parse_python(source)
    eager = _eager_nodes(tree)
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        now = id(node) in eager
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, now) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base:
                found.append((base, node.lineno, now))
            found += [(f"{base}.{alias.name}".strip("."), node.lineno, now) for alias in node.names]
    return found


def _eager_nodes(tree: ast.Module) -> set[int]:
    """Ids of the import nodes that run when the module is imported."""
    eager: set[int] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            eager.add(id(node))
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                pending += node.body
            pending += node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            pending += [stmt for handler in node.handlers for stmt in handler.body]
    return eager


def layer_of(module: str) -> str | None:
    """The layer an ``outbox.*`` module belongs to (None for base modules and the package)."""
    parts = module.split(".")
    if parts[0] != "outbox" or len(parts) < 2:
        return None
    if parts[1] in BASE or parts[1] in ("demo", "json_schemas", "__main__"):
        return "base" if parts[1] in BASE else "cli"
    layer = ALIASES.get(parts[1], parts[1])
    return layer if layer in LAYERS else None


def violations(files: dict[str, str]) -> list[str]:
    """Each import that points from a layer to a higher one, or out of bounds.

    ``files`` maps a module's path relative to the repository to its source.
    """
    found = []
    for relative, source in files.items():
        here = _name(ROOT / relative)
        mine = layer_of(here)
        package = here if relative.endswith("__init__.py") else here.rpartition(".")[0]
        for target, line, eager in _imports(source, package):
            where = f"{relative}:{line} imports {target}"
            top = target.split(".")[0]
            if top == "deliverers" and here.split(".")[:2] not in COMPOSERS:
                found.append(f"{where}: only outbox.cli and outbox.check may import deliverers")
            elif top == "deliverers" and eager:
                # Every deliverer pulls in its client library (kafka, aiosmtplib, ...).
                found.append(f"{where}: deliverers are imported lazily, inside the function")
            if top == "tools" and here.split(".")[0] == "outbox":
                # tools/ (the docs generator, new_migration) is not installed with the package.
                found.append(f"{where}: the installed package may not import tools")
            if top in ("sqlalchemy", "psycopg") and mine not in ("storage",):
                found.append(f"{where}: only outbox.storage imports the database driver")
            theirs = layer_of(target)
            if mine is None or theirs is None or theirs == mine:
                continue
            if mine == "base":
                found.append(f"{where}: base modules import no layer")
                continue
            if theirs == "base":
                continue
            rest = ".".join(target.split(".")[1:3])
            if LAYERS.index(theirs) > LAYERS.index(mine) and (mine, rest) not in ALLOWED:
                found.append(f"{where}: {mine} may not import {theirs}")
    return found


def test_the_package_imports_one_way() -> None:
    files = {str(p.relative_to(ROOT)): p.read_text() for p in _modules("outbox")}
    assert violations(files) == []


def test_deliverers_use_the_deliverer_surface_only() -> None:
    bad = []
    for path in _modules("deliverers"):
        for target, line in imports_of(path.read_text()):
            # outbox.governance.intent_rules: pure data and checks (no I/O), which a deliverer
            # applies again at send time to rows that reached the table around them.
            if target.startswith("outbox.") and not target.startswith(
                (
                    "outbox.delivery",
                    "outbox.errors",
                    "outbox.validation",
                    "outbox.payloads",
                    "outbox.governance.intent_rules",
                )
            ):
                if path.name == "kafka_dedup.py" and target.startswith("outbox.storage"):
                    continue  # the consumer side writes its dedup marks in PostgreSQL
                if path.name == "kafka_txn.py" and target.startswith("outbox.faults"):
                    continue  # its crash point sits between a Kafka send and its commit
                bad.append(f"{path.name}:{line} imports {target}")
            if target.split(".")[0] in ("sqlalchemy", "psycopg"):
                bad.append(f"{path.name}:{line} imports {target}")
    assert bad == []


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "outbox/storage/bad.py",
            "from outbox.runs.run import Run\n",
            "storage may not import runs",
        ),
        (
            "outbox/storage/bad.py",
            "from outbox.delivery import Deliverer\n",
            "storage may not import delivery",
        ),
        ("outbox/runs/bad.py", "from outbox.client import Outbox\n", "runs may not import client"),
        ("outbox/runs/bad.py", "import deliverers.http\n", "only outbox.cli and outbox.check"),
        ("outbox/client.py", "def f():\n    from deliverers import registry\n", "only outbox.cli"),
        (
            "outbox/check/bad.py",
            "from outbox.cli.check import check\n",
            "check may not import cli",
        ),
        ("outbox/runs/bad.py", "from sqlalchemy import text\n", "only outbox.storage imports"),
        ("outbox/storage/bad.py", "from ..runs import run\n", "storage may not import runs"),
        (
            "outbox/storage/sql/bad.py",
            "from ...delivery import x\n",
            "storage may not import delivery",
        ),
        ("outbox/cli/bad.py", "import deliverers.http\n", "imported lazily"),
        ("outbox/cli/bad.py", "from deliverers import registry\n", "imported lazily"),
        (
            "outbox/models.py",
            "from outbox.storage import Connection\n",
            "base modules import no layer",
        ),
        ("outbox/cli/bad.py", "from tools.reference import main\n", "may not import tools"),
        ("outbox/cli/bad.py", "def f():\n    import tools.markdown\n", "may not import tools"),
    ],
)
def test_the_checker_catches_a_wrong_import(module: str, source: str, expected: str) -> None:
    found = violations({module: source})
    assert any(expected in v for v in found), found


def test_the_lazy_rule_leaves_function_and_type_checking_imports_alone() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from deliverers.registry import Registry\n"
        "def f():\n    from deliverers import registry\n"
    )
    assert violations({"outbox/cli/good.py": source}) == []


#: Past this a module holds more than one idea (see the Structure issue).
MAX_MODULE_LINES = 500


def test_every_module_stays_small() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {lines} lines"
        for package in ("outbox", "deliverers", "bench", "tools")
        for path in _modules(package)
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []
