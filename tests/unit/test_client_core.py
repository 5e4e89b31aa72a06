"""The two clients are one implementation: each operation of the core, on both faces.

``Outbox`` inherits :class:`ClientCore`; ``AsyncOutbox`` awaits the same
methods through a greenlet. What a reader of either client sees (the name, the
signature, the docstring) is the core's, so the two cannot drift; the contract
tests (tests/contract) show they also behave alike on a real database.
"""

from __future__ import annotations

import inspect

import pytest

from outbox import AsyncOutbox, AsyncRun, Outbox, Run
from outbox.client_core import ClientCore

#: Operations that return a run: each client wraps what they load in its own handle.
LOADING = {"start_run": "_start_run", "run": "_load_run", "fork": "_fork"}
SHARED = sorted(
    name
    for name, _ in inspect.getmembers(ClientCore, inspect.isfunction)
    if not name.startswith("_") and name != "register_upgrade"
)


@pytest.mark.parametrize("name", [*SHARED, *LOADING])
def test_each_operation_is_on_both_clients_with_the_cores_signature_and_doc(name: str) -> None:
    core = getattr(ClientCore, LOADING.get(name, name))
    sync, aio = getattr(Outbox, name), getattr(AsyncOutbox, name)
    assert inspect.iscoroutinefunction(aio) and not inspect.iscoroutinefunction(sync)
    for face in (sync, aio):
        assert face.__name__ == name
        assert face.__doc__ == core.__doc__ and core.__doc__
        assert inspect.signature(face).parameters == inspect.signature(core).parameters
        if name not in LOADING:
            assert inspect.signature(face) == inspect.signature(core)


@pytest.mark.parametrize("name", LOADING)
def test_loading_operations_say_they_return_each_clients_own_handle(name: str) -> None:
    for client, handle in ((Outbox, Run), (AsyncOutbox, AsyncRun)):
        assert inspect.signature(getattr(client, name)).return_annotation is handle
