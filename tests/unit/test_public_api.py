"""The public surface is what an agent author uses, and every error descends from OutboxError."""

from __future__ import annotations

import importlib
import inspect

import pytest

import outbox
from outbox import errors

#: ``outbox.__all__``: a name added here is a promise to agent authors, so the
#: list is spelled out rather than derived (docs/reference/client.md explains it).
PUBLIC = [
    # the clients, the run and step handles, the workers
    *("Outbox", "AsyncOutbox", "Run", "AsyncRun", "StepTransaction", "AsyncStepTransaction"),
    *("OutboxTransaction", "AsyncOutboxTransaction", "Worker", "AsyncWorker"),
    # models, settings and an intent's approval policy
    *("Effect", "EffectAttempt", "EffectIntent", "EffectStatus", "AttemptOutcome"),
    *("Compensation", "OnConflict", "RunMode", "RunRecord", "RunStart", "RunStatus"),
    *("StepRecord", "StepStatus", "SignalReceipt", "Settings", "WorkerSettings"),
    *("ApprovalPolicy", "OnTimeout"),
    # keys
    *("derive_key", "compensation_key"),
    # the errors that can reach an agent's code
    *("OutboxError", "ConfigurationError", "MissingExtra", "ValidationError", "PayloadError"),
    *("NotFound", "RunNotFound", "EffectNotFound", "IdempotencyConflict", "RunExists"),
    *("ReplayRefused", "RunStateError", "RunTerminal", "RunPaused", "LeaseLost"),
    *("ForkRefused", "StepAlreadyRecorded", "BudgetExceeded", "WaitTimeout", "SignalTimeout"),
    *("EffectTimeout", "EffectFailed", "EffectRejected", "ApprovalRefused", "SchemaError"),
    *("SchemaOutdated", "SchemaTooNew", "DatabaseError", "StoredValueAltered"),
    "__version__",
]

#: Names ``outbox`` no longer exports → the module that holds them (docs/reference/client.md).
ELSEWHERE = {
    "Paused": "outbox.runs.run_base",
    "Suspended": "outbox.runs.run_base",
    "migrate": "outbox.storage.migrate",
    "EmbeddedServer": "outbox.storage.admin.embedded",
    "MigrationError": "outbox.errors",
    "EmbeddedServerError": "outbox.errors",
    "Gate": "outbox.governance.gates",
    "Condition": "outbox.governance.gates",
    "DeliveryError": "outbox.delivery",
    "RetryableError": "outbox.delivery",
    "PermanentError": "outbox.delivery",
}


def test_all_is_the_agent_author_surface() -> None:
    assert sorted(outbox.__all__) == sorted(PUBLIC)


def test_all_lists_every_public_name_of_the_package() -> None:
    public = {name for name in dir(outbox) if not name.startswith("_")} | {"__version__"}
    modules = {name for name in public if inspect.ismodule(getattr(outbox, name))}
    assert set(outbox.__all__) == public - modules - {"annotations"}


@pytest.mark.parametrize(("name", "module"), sorted(ELSEWHERE.items()))
def test_a_name_outside_the_surface_lives_in_its_own_module_only(name: str, module: str) -> None:
    assert getattr(importlib.import_module(module), name) is not None
    # Not a silent re-export: the top level refuses it and says where it went.
    with pytest.raises(AttributeError, match=f"import it from {module}"):
        getattr(outbox, name)
    assert name not in dir(outbox)


def test_every_error_descends_from_outbox_error() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.OutboxError), name
        # Exported, or left out on purpose (deliverer-side and administrative ones).
        assert name in outbox.__all__ or name in ELSEWHERE, name


def test_public_callables_have_docstrings() -> None:
    for name in outbox.__all__:
        obj = getattr(outbox, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__doc__, name
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    assert member.__doc__, f"{name}.{attr}"


def test_all_is_sorted() -> None:
    import outbox.delivery

    for module in (outbox, outbox.delivery):
        assert list(module.__all__) == sorted(module.__all__), module.__name__


def test_the_deliverer_author_surface_is_complete() -> None:
    import outbox.delivery
    from outbox.delivery import contract

    assert set(outbox.delivery.__all__) == set(contract.__all__) | {"is_async"}
    for name in outbox.delivery.__all__:
        assert getattr(outbox.delivery, name) is getattr(contract, name), name
        obj = getattr(outbox.delivery, name)
        assert obj.__doc__, name


def _drawn_tree() -> dict[str, str]:
    """Each class in the tree drawn in outbox/errors.py's docstring, mapped to its drawn parent."""
    doc = errors.__doc__ or ""
    lines = [
        line for line in doc.splitlines() if line.strip().startswith(("OutboxError", "├", "│", "└"))
    ]
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in lines:
        stripped = line.lstrip(" │├└─")
        name = stripped.split()[0] if stripped.strip() else ""
        if not name:
            continue
        depth = len(line) - len(stripped)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            parents[name] = stack[-1][1]
        stack.append((depth, name))
    return parents


def test_the_error_tree_in_the_docstring_matches_the_classes() -> None:
    drawn = _drawn_tree()
    assert set(drawn) | {"OutboxError"} == set(errors.__all__)
    for name, parent in drawn.items():
        cls = getattr(errors, name)
        assert cls.__bases__[0] is getattr(errors, parent), f"{name} is drawn under {parent}"
