"""The docs stay true to the tree: links resolve, named files, modules and tests exist.

Covers README.md and every page under docs/. Three checks:

- every relative link (``[text](path#anchor)``, images included) names an
  existing file, and its anchor a heading of that file (GitHub's slugs);
- every backticked path (``outbox/storage/schema.py``, ``tests/...::test_x``)
  and dotted name (``outbox.storage.admin.archive.read_archive``) exists;
- every test function a page names (``path::test_name``, or ``::test_name``
  after a path, as docs/discussions/guarantees.md's index does) is defined.
"""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

from tests.support import parse_python

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE = re.compile(r"``?([^`\n]+?)``?")
_TOP = ("outbox", "deliverers", "tests", "bench", "examples", "schemas", "clients")
_PATH = re.compile(r"^(?:" + "|".join(_TOP) + r")/[\w./-]*$")
_DOTTED = re.compile(r"^(?:outbox|deliverers)(?:\.\w+)+$")
_TEST_REF = re.compile(r"((?:[\w/]+/)?test_\w+\.py)?::(test_\w+)")


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor of a page: its headings (numbered when repeated) and explicit ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    for _, line in _prose(text):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text))
    return frozenset(found)


def links(path: Path) -> list[tuple[int, str]]:
    """Relative link targets of a page (URLs with a scheme and mail links left out)."""
    found = []
    for number, line in _prose(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            found.append((number, target))
    return found


def broken_links(path: Path) -> list[str]:
    """``page:line: target (why)`` for each link that leads nowhere."""
    broken = []
    for number, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no such heading in {dest.name})")
    return broken


def code_spans(path: Path) -> list[tuple[int, str]]:
    """Backticked text of a page, outside fenced blocks."""
    spans = []
    for number, line in _prose(path.read_text(encoding="utf-8")):
        spans += [(number, span.strip()) for span in _CODE.findall(line)]
    return spans


@cache
def _tree(path: Path) -> ast.Module:
    return parse_python(path.read_text(encoding="utf-8"))


def _defines(body: list[ast.stmt], name: str) -> ast.AST | None:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
        elif isinstance(node, ast.ImportFrom | ast.Import):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return node
        elif isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks, optional imports
            inner = _defines(node.body, name)
            if inner is not None:
                return inner
    return None


def dotted_exists(name: str) -> bool:
    """True when ``a.b.c`` is a module, or a module and names defined in it (read, not imported)."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:split])
        module = base.with_suffix(".py")
        if not module.exists():
            module = base / "__init__.py"
        if not module.exists():
            continue
        body: list[ast.stmt] = _tree(module).body
        for attribute in parts[split:]:
            node = _defines(body, attribute)
            if node is None:
                return False
            body = node.body if isinstance(node, ast.ClassDef) else []
        return True
    return False


@cache
def entry_point_groups() -> frozenset[str]:
    """Entry-point groups pyproject.toml declares (``outbox.deliverers``)."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        project = tomllib.load(handle)["project"]
    return frozenset(project.get("entry-points", {}))


@cache
def sql_settings() -> frozenset[str]:
    """``outbox.<field>`` settings of PostgreSQL the SQL API reads (``Settings`` field names)."""
    from outbox.settings import Settings

    return frozenset(f"outbox.{name}" for name in Settings.model_fields)


@cache
def trace_names() -> frozenset[str]:
    """Span and attribute names of ``outbox/tracing.py`` (``outbox.effect.kind``, ...)."""
    found = set()
    for node in ast.walk(_tree(ROOT / "outbox" / "tracing.py")):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value.strip())
    return frozenset(found)


def _test_files(name: str) -> list[Path]:
    if "/" in name:
        path = ROOT / name
        return [path] if path.exists() else []
    return sorted((ROOT / "tests").rglob(name))


def missing_references(path: Path) -> list[str]:
    """``page:line: name`` for each backticked path, dotted name or test that does not exist."""
    missing = []
    last_file: str | None = None
    for number, span in code_spans(path):
        where = f"{path.relative_to(ROOT)}:{number}: {span}"
        head = span.split("::", 1)[0].split("(", 1)[0]
        if " " in head:  # prose in backticks (`outbox.deliver <kind>`), not a name
            head = ""
        if _PATH.match(head):
            if not (ROOT / head).exists():
                missing.append(f"{where} (no such file)")
            if head.endswith(".py"):
                last_file = head
        elif _DOTTED.match(head) and not (
            dotted_exists(head)
            or head in trace_names()
            or head in entry_point_groups()
            or head in sql_settings()
        ):
            missing.append(f"{where} (no such module or name)")
        for file_name, test in _TEST_REF.findall(span):
            if file_name:
                last_file = file_name
            if last_file is None:
                missing.append(f"{where} (no file named before ::{test})")
                continue
            files = _test_files(last_file)
            if not files:
                missing.append(f"{where} (no test file {last_file})")
            elif not any(_defines_test(f, test) for f in files):
                missing.append(f"{where} (no test {test} in {last_file})")
    return missing


def _defines_test(path: Path, test: str) -> bool:
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == test:
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_file_module_and_test_exists(page: Path) -> None:
    assert missing_references(page) == []


def test_every_page_the_code_names_exists() -> None:
    """Error hints, help texts and docstrings that send a reader to a page."""
    named = set()
    for package in ("outbox", "deliverers", "bench"):
        for path in (ROOT / package).rglob("*.py"):
            named.update(re.findall(r"\bdocs/[\w/.-]+\.md", path.read_text(encoding="utf-8")))
    assert named, "no page named at all: the pattern is wrong"
    assert sorted(n for n in named if not (ROOT / n).exists()) == []


def test_every_page_is_in_the_index() -> None:
    """docs/README.md links every page, so a new how-to or reference page is found."""
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index)}
    pages = [p for p in PAGES if p.parent != ROOT and p != index]
    assert [str(p.relative_to(ROOT)) for p in pages if p.resolve() not in linked] == []


def test_the_checkers_catch_what_they_should(tmp_path: Path) -> None:
    assert slug("G5 Replay") == "g5-replay"
    assert slug("`outbox serve`: signals, console") == "outbox-serve-signals-console"
    assert slug("What an intent may contain") == "what-an-intent-may-contain"
    assert dotted_exists("outbox.storage.admin.archive.read_archive")
    assert dotted_exists("outbox.delivery.contract.Deliverer.lookup")
    assert not dotted_exists("outbox.storage.admin.archive.no_such_function")
    assert not dotted_exists("outbox.no_such_module")
    page = ROOT / "docs" / "_checker_probe.md"
    page.write_text(
        "# Title\n\n[ok](#title) [bad](#nope) [gone](nowhere.md)\n"
        "`outbox/no_such.py` `tests/unit/test_docs.py::test_no_such_test`\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    try:
        assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
            "#nope (no such heading in _checker_probe.md)",
            "nowhere.md (no such file)",
        ]
        found = missing_references(page)
        assert any("outbox/no_such.py (no such file)" in m for m in found), found
        assert any("no test test_no_such_test" in m for m in found), found
    finally:
        page.unlink()
