"""A missing optional extra never crashes a command: one line names the pip install.

``pip install -e .`` (no extras) still registers every shipped deliverer, the
``kafka.publish`` one among them. Each case runs the real command in its own
process with the extra's library hidden (a stand-in package on ``PYTHONPATH``
that fails to import as the missing one does), and also checks
``outbox deliver --check-config``, which reads the config without a database.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = "postgresql://nobody@127.0.0.1:1/outbox"


def hiding(tmp_path: Path, *modules: str) -> str:
    """A ``PYTHONPATH`` entry under which importing ``modules`` fails as if not installed."""
    root = tmp_path / "hidden"
    for module in modules:
        (root / module).mkdir(parents=True, exist_ok=True)
        (root / module / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{module}'\", name={module!r})\n"
        )
    return str(root)


def run(
    args: list[str], env: dict[str, str], hidden: str | None = None
) -> subprocess.CompletedProcess[str]:
    environ = dict(env)
    if hidden is not None:
        environ["PYTHONPATH"] = os.pathsep.join([hidden, str(ROOT)])
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_commands_that_need_a_missing_extra_say_which(
    sub_env: dict[str, str], tmp_path: Path
) -> None:
    no_kafka = hiding(tmp_path / "k", "kafka")
    no_crypto = hiding(tmp_path / "c", "cryptography")
    kafka_config = tmp_path / "kafka.toml"
    kafka_config.write_text('[kinds."events.publish"]\ntype = "kafka.publish"\n')
    outbox = ["-m", "outbox"]
    cases = {
        "relay": ([*outbox, "relay", "--kafka", "127.0.0.1:1"], no_kafka, "kafka"),
        "deliver --from-kafka": (
            [*outbox, "deliver", "--from-kafka", "127.0.0.1:1", "--kind", "http.request"],
            no_kafka,
            "kafka",
        ),
        "a config naming kafka.publish": (
            [*outbox, "deliver", "--check-config", "--config", str(kafka_config)],
            no_kafka,
            "kafka",
        ),
        "audit keygen": (
            [*outbox, "audit", "keygen", "--out", str(tmp_path / "key.pem")],
            no_crypto,
            "audit",
        ),
        "the reference generator": (["-m", "tools.reference", "--check"], no_kafka, "kafka"),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(
            zip(
                cases,
                pool.map(lambda case: run(case[0], sub_env, case[1]), cases.values()),
                strict=True,
            )
        )
    for name, (_, _, extra) in cases.items():
        assert done[name].returncode in (1, 2), (name, done[name].stderr)
        line = one_error_line(done[name])
        assert f"pip install 'agent-outbox[{extra}]'" in line, (name, line)


def test_schemas_check_skips_what_a_missing_extra_makes(
    sub_env: dict[str, str], tmp_path: Path
) -> None:
    done = run(["-m", "outbox", "schemas", "check"], sub_env, hiding(tmp_path, "kafka"))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "skipped: payload.kafka.publish.json: the 'kafka.publish' deliverer needs the 'kafka' "
        "extra (kafka is not installed): pip install 'agent-outbox[kafka]'"
    )
    assert "schemas are in sync" in done.stdout


def test_an_adapter_without_its_framework_names_the_extra(
    sub_env: dict[str, str], tmp_path: Path
) -> None:
    hidden = hiding(tmp_path, "langchain_core", "pydantic_ai", "agents")
    for module, library, extra in (
        ("outbox.integrations.langgraph", "langchain_core", "langgraph"),
        ("outbox.integrations.pydantic_ai", "pydantic_ai", "pydantic-ai"),
        ("outbox.integrations.openai_agents", "agents", "openai-agents"),
    ):
        done = run(["-c", f"import {module}"], sub_env, hidden)
        assert done.returncode == 1
        assert done.stderr.splitlines()[-1] == (
            f"outbox.errors.MissingExtra: {module} needs the {extra!r} extra ({library} is not "
            f"installed): pip install 'agent-outbox[{extra}]'"
        ), done.stderr


@pytest.mark.parametrize(
    ("text", "code", "expected"),
    [
        (
            '[kinds."http.request"]\nallow_private = ["127.0.0.1"]\n'
            '[[approvals]]\nname = "big"\nkind = "http.request"\n',
            0,
            "config ok",
        ),
        (
            '[[approval]]\nname = "big"\nkind = "http.request"\n',
            1,
            "error: ConfigurationError: approval: unknown table (did you mean 'approvals'?)",
        ),
        (
            '[kind."http.request"]\nallow_private = ["127.0.0.1"]\n',
            1,
            "error: ConfigurationError: kind: unknown table (did you mean 'kinds'?)",
        ),
    ],
)
def test_check_config_validates_without_a_database(
    sub_env: dict[str, str], tmp_path: Path, text: str, code: int, expected: str
) -> None:
    config = tmp_path / "deliverers.toml"
    config.write_text(text)
    env = {**sub_env, "OUTBOX_DSN": UNREACHABLE}
    done = run(["-m", "outbox", "deliver", "--check-config", "--config", str(config)], env)
    assert done.returncode == code, done.stderr
    if code:
        assert one_error_line(done) == expected
    else:
        assert expected in done.stdout and "1 approval gate(s): big" in done.stdout
