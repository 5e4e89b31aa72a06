"""docs/quickstart.md, followed as written by a new user on their own PostgreSQL.

The shell and Python blocks of "Your own PostgreSQL", "A run in code" and
"Deliver the effects" are read from the page and run: ``outbox migrate`` on an
empty database (before it, ``Outbox.connect`` is refused with
``SchemaOutdated``, as the page says), then ``outbox sink``, the deliverers
config the page writes, ``outbox deliver``, ``examples/quickstart.py`` twice
(the page shows that file whole: the second run replays the first), and the
page's intent outside a run, each delivered to the sink once. Only the port
is changed.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from outbox import Outbox, SchemaOutdated
from tests.support import wait_for

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
EXAMPLE = ROOT / "examples" / "quickstart.py"
DOC_PORT = "8081"


def section_blocks(heading: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block under the ``## heading`` of the quickstart."""
    text = PAGE.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)\n```", section, flags=re.S)


def commands(script: str) -> list[list[str]]:
    """The ``outbox ...`` lines of a shell block, comments and a trailing ``&`` dropped."""
    found = []
    for line in script.splitlines():
        line = line.split("#", 1)[0].strip().removesuffix("&").strip()
        if line.startswith("outbox "):
            found.append(shlex.split(line))
    return found


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def outbox_cli(args: list[str]) -> list[str]:
    """A page's ``outbox ...`` command, run by this interpreter."""
    return [sys.executable, "-m", "outbox", *args[1:]]


@pytest.fixture
def env(empty_dsn: str, sub_env: dict[str, str]) -> dict[str, str]:
    return {**sub_env, "OUTBOX_DSN": empty_dsn}


def test_the_page_shows_the_example_whole() -> None:
    (_, shell), (_, shown) = section_blocks("A run in code")[:2]
    assert shown + "\n" == EXAMPLE.read_text(encoding="utf-8")
    runs = [line.split("#", 1)[0].split() for line in shell.splitlines() if "quickstart" in line]
    assert runs == [["python", "examples/quickstart.py"]] * 2, "the page runs it twice"


def test_the_quickstart_on_your_own_postgresql(
    empty_dsn: str, env: dict[str, str], tmp_path: Path
) -> None:
    ((lang, setup),) = section_blocks("Your own PostgreSQL")
    assert lang == "bash" and "export OUTBOX_DSN=" in setup
    with pytest.raises(SchemaOutdated, match="outbox migrate"):
        Outbox.connect(empty_dsn).close()
    migrate = [c for c in commands(setup) if c[1] == "migrate"]
    assert migrate == [["outbox", "migrate"]], "the page's first command is outbox migrate"
    subprocess.run(outbox_cli(migrate[0]), env=env, cwd=tmp_path, check=True)

    (_, shell), *_ = section_blocks("A run in code")
    ((_, python),) = section_blocks("Deliver the effects")
    port = free_port()
    shell, python = shell.replace(DOC_PORT, port), python.replace(DOC_PORT, port)
    config = re.search(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF", shell, flags=re.S)
    assert config is not None, "the page writes a deliverers config"
    (tmp_path / config.group(1)).write_text(config.group(2) + "\n")
    sink_cmd, deliver_cmd = commands(shell)
    assert sink_cmd[:2] == ["outbox", "sink"] and deliver_cmd[:2] == ["outbox", "deliver"]

    procs = [
        subprocess.Popen(outbox_cli(c), env=env, cwd=tmp_path) for c in (sink_cmd, deliver_cmd)
    ]
    ob = Outbox.connect(empty_dsn)
    try:
        first, again = (
            subprocess.run(
                [sys.executable, str(EXAMPLE), f"http://127.0.0.1:{port}"],
                env=env,
                cwd=tmp_path,
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            ).stdout
            for _ in range(2)
        )
        assert "fetching the invoices" in first and "fetching" not in again, "a replay"
        assert "succeeded" in first, first
        assert first.splitlines()[-2:] == again.splitlines(), "the same run, the same effect"
        (run,) = ob.runs()
        assert run.status.value == "completed" and run.agent == "invoice-reconciler"
        (summary,) = ob.effects()
        assert summary.status.value == "succeeded" and summary.run_id == run.id
        with ob.store.engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT month FROM quickstart_closings").all()
        assert rows == [("2026-10",)], "the example's own row, written once"

        exec(python, {"ob": ob})  # the page's intent outside a run, as written
        wait_for(
            lambda: all(e.status.value == "succeeded" for e in ob.effects()),
            timeout=60,
            message="the quickstart's intent delivered",
        )
        listed = subprocess.run(
            [sys.executable, "-m", "outbox", "effects", "list", "--json"],
            env=env,
            cwd=tmp_path,
            check=True,
            capture_output=True,
            text=True,
        )
        shown = json.loads(listed.stdout)
        assert [e["status"] for e in shown] == ["succeeded", "succeeded"]
        assert shown[0]["run_id"] is None, "newest first: the intent outside a run"
        stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=10).json()
        assert stats["keys_applied"] == 2 and stats["duplicate_keys_applied"] == []
    finally:
        ob.close()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=30)
