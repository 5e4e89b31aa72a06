"""The reference pages keep up with the code: a new setting, option, error or report needs its line.

Most tables are generated (``python -m outbox.cli.reference``); the first test
fails when a generated block is stale. The others check the pages by name,
independently of the generator, so a name the generator missed fails too.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import click
import pytest

import outbox
import outbox.delivery
from outbox import errors
from outbox.cli import reference
from outbox.cli.schemas import exported_models

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


def page(name: str) -> str:
    return (REFERENCE / name).read_text(encoding="utf-8")


def test_generated_blocks_match_the_code() -> None:
    assert reference.stale_pages(ROOT) == [], "run `python -m outbox.cli.reference` and commit"


def test_a_stale_block_is_found_and_rewritten(tmp_path: Path) -> None:
    shutil.copytree(REFERENCE, tmp_path / "docs" / "reference")
    settings = tmp_path / "docs" / "reference" / "settings.md"
    settings.write_text(settings.read_text().replace("| `pool_size` |", "| `pool_sighs` |"))
    assert reference.main(["--root", str(tmp_path), "--check"]) == 1
    assert reference.main(["--root", str(tmp_path)]) == 0
    assert settings.read_text() == page("settings.md")


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="markers of block 'settings' are missing"):
        reference.render_page("# Settings\n", {"settings": "| a |"}, "settings.md")
    begin = reference.MARK_BEGIN.format(name="b")
    end = reference.MARK_END.format(name="b")
    assert reference.render_page(f"x\n{begin}\nold\n{end}\ny", {"b": "new"}) == (
        f"x\n{begin}\nnew\n{end}\ny"
    )


@pytest.mark.parametrize(
    "model", [m for m, *_ in reference.settings_classes()], ids=lambda m: m.__name__
)
def test_every_setting_is_in_the_reference_with_its_meaning(model: type) -> None:
    text = page("settings.md")
    for name in model.model_fields:
        assert f"| `{name}` |" in text, f"{model.__name__}.{name} is not in settings.md"
        assert reference.field_meaning(model, name), (
            f"{model.__name__}.{name} has no meaning: add a `#:` comment above it"
        )


def test_every_deliverer_config_key_is_in_the_reference_with_its_meaning() -> None:
    text = page("deliverers-config.md")
    shipped = {s.name for s in reference.shipped_deliverers()}
    assert {"http.request", "python.call", "smtp.send"} <= shipped
    for model in [*reference.config_models(), *reference.gate_models()]:
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.__name__}.{name}"
            assert reference.field_meaning(model, name), f"{model.__name__}.{name}: no `#:`"
    for name in shipped:
        assert f"### `{name}`" in text


def test_every_command_and_option_is_in_the_cli_reference_with_help() -> None:
    text = page("cli.md")
    commands = reference.commands()
    assert len(commands) > 20
    for path, command in commands:
        heading = reference.command_heading(path)
        assert f"### `{heading}`" in text, heading
        section = text.split(f"### `{heading}`\n", 1)[1].split("\n### ", 1)[0]
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert f"`{param.opts[0]}`" in section, f"{heading} {param.opts[0]}"
                assert param.help, f"{heading} {param.opts[0]} has no help text"


def test_every_error_is_in_the_errors_reference() -> None:
    text = page("errors.md")
    for name in errors.__all__:
        if isinstance(getattr(errors, name), type):
            assert f"`{name}`" in text, name


@pytest.mark.parametrize(
    ("module", "name"),
    [(outbox, "client.md"), (outbox.delivery, "deliverer-contract.md")],
    ids=["outbox", "outbox.delivery"],
)
def test_every_exported_name_is_in_its_reference(module: object, name: str) -> None:
    text = page(name)
    for export in module.__all__:  # type: ignore[attr-defined]
        assert f"| `{export}` |" in text, f"{export} is not in {name}"


def test_every_json_shape_is_in_the_json_reference() -> None:
    text = page("json.md")
    for name in exported_models():
        assert f"../../schemas/{name}.json" in text, name


def test_every_metric_is_in_the_metrics_reference() -> None:
    text = page("metrics.md")
    for _, name, *_ in reference.metric_families():
        assert f"`{name}`" in text, name


def test_every_environment_variable_the_code_reads_is_in_the_settings_reference() -> None:
    read = set()
    for package in ("outbox", "deliverers"):
        for path in (ROOT / package).rglob("*.py"):
            read.update(re.findall(r"\bOUTBOX_[A-Z_]*[A-Z]\b", path.read_text(encoding="utf-8")))
    documented = {name for name, *_ in reference.environment()}
    read.discard("OUTBOX_")  # the prefix itself, where a name is built
    assert sorted(read - documented) == []
    text = page("settings.md")
    assert all(f"`{name}`" in text for name in documented)


def _classes_deriving(package: str, bases: set[str]) -> set[str]:
    """Class names under ``package`` deriving (through classes found there) from ``bases``."""
    found: dict[str, list[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                found[node.name] = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
    derived: set[str] = set()
    while True:
        more = {name for name, parents in found.items() if set(parents) & (bases | derived)}
        if more <= derived:
            return derived
        derived |= more


def test_every_settings_class_has_a_section() -> None:
    """A new ``...Settings`` model gets a line in ``settings_classes()`` (and so a table)."""
    declared = {
        name for name in _classes_deriving("outbox", {"BaseModel"}) if name.endswith("Settings")
    }
    listed = {model.__name__ for model, *_ in reference.settings_classes()}
    assert declared == listed, "add the class to outbox/cli/reference.py's settings_classes()"
    text = page("settings.md")
    for name in listed:
        assert f"### `{name}`" in text
        assert f"| [`{name}`](#{name.lower()}) |" in text, f"{name}: a row in the table at the top"


def test_every_shipped_deliverer_config_is_in_the_reference() -> None:
    """A config model in ``deliverers/`` belongs to a shipped (entry-point) type: listed."""
    declared = _classes_deriving("deliverers", {"DelivererConfig"})
    listed = {model.__name__ for model in reference.config_models()}
    assert declared, "no DelivererConfig subclass found"
    assert declared <= listed, "register the type in pyproject.toml's outbox.deliverers"


def test_the_consumer_tuning_shown_is_the_one_the_tests_use() -> None:
    """docs/howto/stream-mode.md shows ``TANSU_CONSUMER_TUNING`` option by option."""
    from deliverers.testing import TANSU_CONSUMER_TUNING

    text = (ROOT / "docs" / "howto" / "stream-mode.md").read_text(encoding="utf-8")
    shown = dict(re.findall(r"--kafka-option (\w+)=(\d+)", text))
    assert shown == {key: str(value) for key, value in TANSU_CONSUMER_TUNING.items()}


@pytest.mark.parametrize(
    "cls",
    [
        outbox.Outbox,
        outbox.AsyncOutbox,
        outbox.Run,
        outbox.AsyncRun,
        outbox.StepTransaction,
        outbox.AsyncStepTransaction,
        outbox.OutboxTransaction,
        outbox.AsyncOutboxTransaction,
        outbox.Worker,
        outbox.AsyncWorker,
    ],
    ids=lambda cls: cls.__name__,
)
def test_every_public_method_of_the_client_is_in_the_client_reference(cls: type) -> None:
    """What an agent calls (``ob.x``, ``run.x``, ``tx.x``) is described in client.md."""
    text = page("client.md")
    missing = [
        name
        for name in dir(cls)
        if not name.startswith("_") and not re.search(rf"`[^`]*\b{name}\b[^`]*`", text)
    ]
    assert missing == [], f"{cls.__name__}: {missing} not in docs/reference/client.md"
