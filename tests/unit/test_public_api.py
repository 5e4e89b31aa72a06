"""Everything public is exported, and every error descends from OutboxError."""

from __future__ import annotations

import inspect

import outbox
from outbox import errors


def test_all_lists_every_public_name_of_the_package() -> None:
    public = {name for name in dir(outbox) if not name.startswith("_")} | {"__version__"}
    modules = {name for name in public if inspect.ismodule(getattr(outbox, name))}
    assert set(outbox.__all__) == public - modules - {"annotations"}


def test_every_error_descends_from_outbox_error() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.OutboxError), name
        assert name in outbox.__all__, name


def test_public_callables_have_docstrings() -> None:
    for name in outbox.__all__:
        obj = getattr(outbox, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__, name
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    assert member.__doc__, f"{name}.{attr}"
