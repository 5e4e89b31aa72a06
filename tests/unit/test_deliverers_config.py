"""One deliverers config model: every table and key checked, a misspelling named with a hint.

A typo in a table's name used to be ignored: ``[[approval]]`` applied no gate
(and ``outbox deliver`` then delivered the kind ungated), ``[kind."http.request"]``
counted as no config at all. Now the file is read once, into one model, and
refused at the first thing it does not know, wherever it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from deliverers.http import HttpConfig
from deliverers.registry import available_types, build_registry, load_config, parse_config
from outbox.delivery import Deliverer, DelivererConfig
from outbox.delivery.config import DeliverersConfig
from outbox.errors import ConfigurationError, MissingExtra

FULL = """
[kinds."http.request"]
allow_private = ["127.0.0.1"]

[kinds."payments.send"]
type = "http.request"

[[approvals]]
name = "large-payments"
kind = "payments.send"
when = [ { pointer = "/json/amount", op = "gt", value = 10000 } ]
timeout = "24h"

[dry_run]
recorded = false
[dry_run.stubs."payments.send"]
result = { status = 200 }
"""


def refused(text: str, tmp_path: Path) -> str:
    path = tmp_path / "deliverers.toml"
    path.write_text(text)
    with pytest.raises(ConfigurationError) as info:
        load_config(path)
    return str(info.value)


def test_one_model_holds_the_kinds_the_gates_and_the_dry_run(tmp_path: Path) -> None:
    path = tmp_path / "deliverers.toml"
    path.write_text(FULL)
    config = load_config(path)
    assert isinstance(config, DeliverersConfig)
    assert {k: t.type for k, t in config.kinds.items()} == {
        "http.request": "http.request",
        "payments.send": "http.request",
    }
    settings = config.kinds["http.request"].settings
    assert isinstance(settings, HttpConfig) and settings.allow_private == ["127.0.0.1"]
    (gate,) = config.approvals
    assert (gate.name, gate.kind, gate.timeout) == ("large-payments", "payments.send", 86400)
    assert config.dry_run.recorded is False
    assert config.dry_run.stubs["payments.send"].result == {"status": 200}
    # The registry is built from the same model, not from the file again.
    assert sorted(build_registry(config)) == ["http.request", "payments.send"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # The two typos of the issue: a gate that was silently dropped, a kind's settings
        # that were silently replaced by every default.
        (
            '[[approval]]\nname = "g"\nkind = "payments.send"\n',
            "approval: unknown table (did you mean 'approvals'?)",
        ),
        (
            '[kind."http.request"]\nallow_private = ["127.0.0.1"]\n',
            "kind: unknown table (did you mean 'kinds'?)",
        ),
        ("[dryrun]\nrecorded = false\n", "dryrun: unknown table (did you mean 'dry_run'?)"),
        (
            "[deliverers]\n",
            "deliverers: unknown table (known: approvals, dry_run, kinds)",
        ),
        # inside a kind, at any depth
        (
            '[kinds."http.request"]\nallow_privat = ["127.0.0.1"]\n',
            "deliverer 'http.request': allow_privat: unknown key (did you mean 'allow_private'?)",
        ),
        (
            '[kinds."http.request".credentials.billing]\nevn = "TOKEN"\n',
            "deliverer 'http.request': credentials.billing.evn: unknown key (did you mean 'env'?)",
        ),
        # inside a gate and its conditions
        (
            '[[approvals]]\nnme = "g"\nkind = "k"\n',
            "approvals[0].nme: unknown key (did you mean 'name'?)",
        ),
        (
            '[[approvals]]\nname = "g"\nkind = "k"\nwhen = [{ pointr = "/a", op = "eq" }]\n',
            "approvals[0].when[0].pointr: unknown key (did you mean 'pointer'?)",
        ),
        (
            '[[approvals]]\nname = "g"\nkind = "k"\non_timout = "reject"\n',
            "approvals[0].on_timout: unknown key (did you mean 'on_timeout'?)",
        ),
        # inside the dry run
        ("[dry_run]\nstub = {}\n", "dry_run.stub: unknown key (did you mean 'stubs'?)"),
        (
            '[dry_run.stubs."http.request"]\nreslt = 1\n',
            "dry_run.stubs.http.request.reslt: unknown key (did you mean 'result'?)",
        ),
    ],
)
def test_an_unknown_table_or_key_is_refused_with_a_hint(
    text: str, message: str, tmp_path: Path
) -> None:
    assert refused(text, tmp_path) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("approvals = 3\n", "approvals: must be an array of tables ([[approvals]])"),
        ("dry_run = 3\n", "dry_run: must be a table ([dry_run])"),
        (
            "[dry_run]\nrecorded = 3\n",
            "dry_run.recorded=3: Input should be a valid boolean, unable to interpret input",
        ),
        (
            '[[approvals]]\nname = "g"\nkind = "k"\n[[approvals]]\nname = "g"\nkind = "k2"\n',
            "approvals: name 'g' is declared twice",
        ),
        (
            '[[approvals]]\nname = "g"\nkind = "k"\ntimeout = "soon"\n',
            "approvals[0].timeout='soon': must be a number of seconds or a text like "
            "'90s', '15m', '24h', '7d'",
        ),
    ],
)
def test_a_bad_value_names_its_place(text: str, message: str, tmp_path: Path) -> None:
    assert refused(text, tmp_path) == message


def test_a_config_with_only_gates_still_serves_every_installed_type() -> None:
    config = parse_config({"approvals": [{"name": "g", "kind": "http.request"}]})
    assert config.kinds == {} and [g.name for g in config.approvals] == ["g"]
    installed = {n for n, c in available_types().items() if c.default_registered}
    assert set(build_registry(config)) == installed


def test_a_type_whose_extra_is_missing_names_the_pip_install() -> None:
    missing = ModuleNotFoundError("No module named 'kafka'", name="kafka")
    raw: dict[str, Any] = {"kinds": {"events": {"type": "kafka.publish"}}}
    with pytest.raises(MissingExtra) as info:
        DeliverersConfig.parse(raw, {}, {"kafka.publish": missing})
    assert str(info.value) == (
        "kinds.events.type='kafka.publish' needs the 'kafka' extra (kafka is not installed): "
        "pip install 'agent-outbox[kafka]'"
    )
    assert isinstance(info.value, ConfigurationError) and isinstance(info.value, ImportError)


# -- one preamble: a deliverer names its settings model once, as its base's parameter ----


class _Colour(DelivererConfig):
    colour: str = "red"


class _Painter(Deliverer[_Colour]):
    pass


class _Restorer(_Painter):
    """A subclass of a subclass keeps its parent's model."""


class _Declared(Deliverer[_Colour]):
    """A model the class sets itself wins over the base's parameter."""

    config_model: ClassVar[type[DelivererConfig]] = HttpConfig


def test_the_base_parameter_is_the_settings_model() -> None:
    assert _Painter.config_model is _Colour and _Restorer.config_model is _Colour
    assert _Declared.config_model is HttpConfig
    assert Deliverer.config_model is DelivererConfig
    assert _Painter("paint").config == _Colour()
    assert _Painter.from_config("paint", {"colour": "blue"}).config.colour == "blue"


def test_a_table_is_checked_by_the_model_the_base_names() -> None:
    with pytest.raises(ConfigurationError) as info:
        _Painter.parse_config("paint", {"colur": "blue"})
    assert str(info.value) == "deliverer 'paint': colur: unknown key (did you mean 'colour'?)"
    with pytest.raises(ConfigurationError, match=r"^kinds\.paint must be a table$"):
        _Painter.parse_config("paint", ["blue"])  # type: ignore[arg-type]


def test_a_config_of_another_model_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="config must be a _Colour, not HttpConfig"):
        _Painter("paint", HttpConfig())


def test_the_kinds_are_checked_before_the_gates_and_the_dry_run(tmp_path: Path) -> None:
    text = '[kinds."http.request"]\nallow_privat = []\n[[approval]]\n'
    assert refused(text, tmp_path) == "approval: unknown table (did you mean 'approvals'?)"
    text = '[kinds."http.request"]\nallow_privat = []\n[[approvals]]\nnme = "g"\n'
    assert refused(text, tmp_path).startswith("deliverer 'http.request': allow_privat")
    text = '[[approvals]]\nnme = "g"\n[dry_run]\nstub = {}\n'
    assert refused(text, tmp_path).startswith("approvals[0].nme")
