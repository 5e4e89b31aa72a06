"""Least-privilege roles (``outbox roles``): what agents, deliverers, operators and readers may do.

Four group roles (``NOLOGIN``); give each login one of them
(``CREATE ROLE billing_agent LOGIN PASSWORD '...' IN ROLE outbox_agent``):

- ``outbox_agent``: starts runs (and forks them), commits steps with their
  intents and the large values they store by reference, sends and consumes
  signals, parks and wakes its runs. It cannot complete, retry or delete an
  effect: of ``outbox_effects`` it may only insert fresh intents (``pending``,
  held for approval, or ``paused`` for a paused run; never attempted) and mark
  one awaited.
- ``outbox_deliverer``: claims (charging a kind's shared rate), heartbeats,
  completes and reconciles effects, and moves stopping runs on (which updates
  ``outbox_runs`` and intends their compensations). It cannot change what an
  effect is (kind, payload, key) and cannot insert intents: only the
  compensations an agent declared on a succeeded effect of a run being cancelled.
- ``outbox_operator``: resolves, retries, cancels (its cancel moves the run
  on like a deliverer), pauses and resumes, approves and rejects held effects,
  manages approval gates, reconciles, and deletes history (``outbox gc``, large
  values included).
- ``outbox_reader``: reads every table.

Column privileges restrict inserts and updates; triggers refuse the transitions
a column grant would otherwise allow: a recorded step never changes (an agent
cannot rewrite a result), and only a session with EXECUTE on
``outbox_may_release()`` (the operator's) moves an effect held for approval to
``pending`` or a paused run back to live (a deliverer cannot approve, an agent
cannot un-pause). The hash chain's columns (``outbox_runs.step_head``,
``outbox_steps.hash``) and a signal's consumption are granted to no role: the
``SECURITY DEFINER`` step writers (``STEP_WRITERS``, EXECUTE for the agent
only) compute them from what is recorded, and a signal is consumed only by a
wait of the run it was sent to, which records its payload. Row-level security policies on
``outbox_effects`` (the table owner, which runs migrations and the step writers,
is not subject to them) restrict inserts: a fresh row, one no configured gate
holds unless it is held for approval (``outbox_intent_gated``: a hand-written
INSERT skips no gate), an agent's only into a run that takes intents, a
compensation only as its original declared it (``outbox_compensation_declared``;
the three in functions/insert_checks.sql). Triggers keep what
an operator ended ended: only a session with EXECUTE on ``outbox_may_release()``
reopens a failed, cancelled, rejected or compensated effect
(``outbox_effects_hold_paused``), and no one brings an ended run back
(``outbox_runs_ended_guard``). Applying the script
again brings the roles to exactly these grants.

With ``namespace`` the four roles are confined to one namespace: row-level
security on every run-scoped table, and the step writers' own check
(functions/namespaces.sql). Every policy is permissive.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sqlalchemy import Engine

from outbox.errors import ValidationError
from outbox.shards import NAMESPACE_PATTERN
from outbox.storage.admin.role_policies import CONFINED, role_policies
from outbox.storage.engine import translate_errors
from outbox.storage.schema import metadata

__all__ = [
    "ROLES",
    "STEP_WRITERS",
    "RoleSpec",
    "apply_roles",
    "grants_markdown",
    "namespace_prefix",
    "role_script",
]

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")

# Columns of outbox_effects that delivery changes (never what the effect is).
_EFFECT_DELIVERY = (
    "status",
    "result",
    "last_error",
    "available_at",
    "lease_owner",
    "lease_expires_at",
    "attempt",
    "attempt_started_at",
    "completed_at",
    "updated_at",
)
# Columns of outbox_runs that a finished effect, a cancellation or its
# compensation change (wake a parked run, settle its cost, stop it).
_RUN_STOPPING = (
    "status",
    "cancel_reason",
    "available_at",
    "lease_owner",
    "lease_expires_at",
    "wake_at",
    "wait_signal",
    "wait_effect",
    "reserved",
    "spent",
    "updated_at",
    "paused_at",
    "pause_reason",
)
# Columns of outbox_runs a worker changes while it drives a run.
_RUN_AGENT = (
    "agent_version",
    "status",
    "state",
    "plan",
    "current_step",
    "step_count",
    "result",
    "error",
    "available_at",
    "lease_owner",
    "lease_expires_at",
    "attempt",
    "updated_at",
    "wake_at",
    "wait_signal",
    "wait_effect",
    "step_retries",
    "upgrades",
)
# (Not spent and reserved: a step's debits and reservations are written by
# outbox_write_step, which runs as the tables' owner, so an agent that could set
# them would only be able to undo its own budget.)
# Columns of outbox_effects an approval decision, a deadline or an escalation change.
_EFFECT_APPROVAL = ("approval", "approval_deadline")

Grant = tuple[str, ...]  # privileges; "UPDATE(a, b)" for columns


@dataclass(frozen=True)
class RoleSpec:
    """One group role: its name after the prefix, what it is for, and its grants per table."""

    suffix: str
    purpose: str
    grants: dict[str, Grant] = field(default_factory=dict)


def _update(columns: tuple[str, ...]) -> str:
    return f"UPDATE ({', '.join(columns)})"


def _insert_except(table: str, *excluded: str) -> str:
    """INSERT on every column of ``table`` but ``excluded`` (a new column is granted too)."""
    columns = [c.name for c in metadata.tables[table].columns]
    assert set(excluded) <= set(columns), (table, excluded)
    return f"INSERT ({', '.join(c for c in columns if c not in excluded)})"


# The hash chain's columns: written only by the SECURITY DEFINER step writers
# (outbox_write_step, outbox_complete_wait, outbox_take_signal, outbox_chain_fork),
# never granted. Their argument lists, for the EXECUTE grant.
STEP_WRITERS = (
    "outbox_write_step(smallint, uuid, text, jsonb, jsonb, jsonb, jsonb, text, jsonb, text,"
    " integer, boolean)",
    "outbox_complete_wait(smallint, uuid, text, jsonb, jsonb)",
    "outbox_take_signal(smallint, uuid, text, text)",
    "outbox_chain_fork(smallint, uuid, text[])",
)


_READ_ALL = {t: ("SELECT",) for t in metadata.tables}

# Configuration every namespace shares: a confined login reads it, changes none of it.
_SHARED_CONFIG = ("outbox_gates",)
# Large values, shared by every namespace that stores the same text: a confined
# login stores them and reads those its namespace uses, deletes none (`outbox gc`
# leaves them).
_SHARED_VALUES = ("outbox_blobs", "outbox_blob_refs")
_NAMESPACE = re.compile(NAMESPACE_PATTERN)

ROLES: tuple[RoleSpec, ...] = (
    RoleSpec(
        "agent",
        "start runs, commit steps and intents, send and consume signals; no completion",
        {
            **_READ_ALL,
            # the chain's head and links and a signal's consumption are written by
            # the step writers only (STEP_WRITERS): not granted
            "outbox_runs": (
                "SELECT",
                _insert_except("outbox_runs", "step_head"),
                _update(_RUN_AGENT),
            ),
            "outbox_steps": ("SELECT", _insert_except("outbox_steps", "hash")),
            "outbox_effects": ("SELECT", "INSERT", _update(("awaited_by",))),
            "outbox_signals": (
                "SELECT",
                _insert_except("outbox_signals", "consumed_by", "consumed_at"),
            ),
            "outbox_budget_ledger": ("SELECT", "INSERT"),
            # outbox serve remembers signed requests; a Kafka DedupConsumer marks keys
            "outbox_webhook_replays": ("SELECT", "INSERT", "DELETE"),
            "outbox_consumed_keys": ("SELECT", "INSERT"),
            # large values: stored once (a writer leaves one already there), used by a run
            "outbox_blobs": ("SELECT", "INSERT"),
            "outbox_blob_refs": ("SELECT", "INSERT"),
            # a business key, a caller's idempotency key: registered on its shard
            "outbox_run_keys": ("SELECT", "INSERT"),
            "outbox_effect_keys": (
                "SELECT",
                "INSERT",
                _update(("effect_id", "run_id", "kind", "payload_hash")),
            ),
        },
    ),
    RoleSpec(
        "deliverer",
        "claim, heartbeat, complete, reconcile; move stopping runs on; no intents",
        {
            **_READ_ALL,
            "outbox_runs": ("SELECT", _update(_RUN_STOPPING)),
            "outbox_effects": (
                "SELECT",
                "INSERT",
                _update((*_EFFECT_DELIVERY, *_EFFECT_APPROVAL, "attempt_note")),
            ),
            "outbox_effect_attempts": ("SELECT", "INSERT"),
            "outbox_budget_ledger": ("SELECT", "INSERT"),
            # a kind's declared rate, shared by every deliverer process
            "outbox_rate_limits": ("SELECT", "INSERT", _update(("tat",))),
            # `outbox deliver` stores the config's approval gates at start-up
            "outbox_gates": ("SELECT", "INSERT", "UPDATE", "DELETE"),
            # a daemon registers the owner whose session lock it holds (0012)
            "outbox_owners": ("SELECT", "INSERT", _update(("registered_at",)), "DELETE"),
        },
    ),
    RoleSpec(
        "operator",
        "resolve, retry, cancel, pause and resume, approve and reject, manage gates, "
        "reconcile, gc; no intents",
        {
            **_READ_ALL,
            "outbox_runs": ("SELECT", _update(_RUN_STOPPING), "DELETE"),
            "outbox_steps": ("SELECT", "DELETE"),
            "outbox_effects": (
                "SELECT",
                "INSERT",
                _update((*_EFFECT_DELIVERY, *_EFFECT_APPROVAL, "max_attempts")),
                "DELETE",
            ),
            "outbox_gates": ("SELECT", "INSERT", "UPDATE", "DELETE"),
            "outbox_effect_attempts": ("SELECT", "INSERT", "DELETE"),
            "outbox_signals": ("SELECT", "DELETE"),
            "outbox_budget_ledger": ("SELECT", "INSERT", "DELETE"),
            "outbox_webhook_replays": ("SELECT", "DELETE"),
            "outbox_consumed_keys": ("SELECT", "DELETE"),
            # gc locks a blob nothing uses (skipping one a writer holds), then deletes it
            "outbox_blobs": ("SELECT", _update(("used_at",)), "DELETE"),
            "outbox_blob_refs": ("SELECT", "DELETE"),
            "outbox_owners": ("SELECT", "DELETE"),
            "outbox_run_keys": ("SELECT", "DELETE"),
            "outbox_effect_keys": ("SELECT", "DELETE"),
        },
    ),
    RoleSpec("reader", "read everything; change nothing", dict(_READ_ALL)),
)


def _check(name: str, value: str) -> str:
    if not _IDENT.match(value):
        raise ValidationError(name, value, "must be a lower-case SQL identifier (a-z, 0-9, _)")
    return value


def namespace_prefix(namespace: str) -> str:
    """The role prefix ``outbox roles --namespace`` uses by default: ``outbox_<namespace>_``."""
    prefix = "outbox_" + re.sub(r"[.-]", "_", namespace) + "_"
    if not _IDENT.match(prefix):
        raise ValidationError(
            "namespace", namespace, f"makes no role prefix ({prefix!r}): give one with --prefix"
        )
    return prefix


def role_script(
    prefix: str = "outbox_", schema: str = "public", namespace: str | None = None
) -> list[str]:
    """The statements that create (or bring up to date) the four roles, in order.

    With ``namespace``, the four roles (named with ``prefix``) are confined to it
    (outbox.storage.admin.role_policies). Run them in one transaction as the owner of the outbox
    tables (or a superuser).
    """
    prefix = _check("prefix", prefix)
    schema = _check("schema", schema)
    if namespace is not None and not _NAMESPACE.match(namespace):
        raise ValidationError("namespace", namespace, f"must match {_NAMESPACE.pattern}")
    names = {spec.suffix: f"{prefix}{spec.suffix}" for spec in ROLES}
    tables = [f"{schema}.{name}" for name in metadata.tables]
    out: list[str] = []
    for role in (*names.values(), *([] if namespace is None else [CONFINED])):
        out.append(
            "DO $$ BEGIN\n"
            f"    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN\n"
            f"        CREATE ROLE {role} NOLOGIN;\n"
            "    END IF;\n"
            "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;\n"
            "END $$"
        )
    every = ", ".join(names.values())
    out.append(
        f"DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %I TO {every}', "
        "current_database()); END $$"
    )
    out.append(f"GRANT USAGE ON SCHEMA {schema} TO {every}")
    # Brought to exactly these grants: whatever an earlier version granted goes first.
    out.append(f"REVOKE ALL ON {', '.join(tables)} FROM {every}")
    for spec in ROLES:
        for table, privileges in spec.grants.items():
            if namespace is not None and table in _SHARED_CONFIG:
                privileges = ("SELECT",)
            elif namespace is not None and table in _SHARED_VALUES:
                privileges = tuple(p for p in privileges if p != "DELETE")
            out.append(f"GRANT {', '.join(privileges)} ON {schema}.{table} TO {names[spec.suffix]}")
    # The SQL API's wake-up throttle (0007) reads and moves these; an agent calls it.
    clocks = ", ".join(f"{schema}.{name}" for name in sorted(metadata._sequences))
    out.append(f"GRANT SELECT, UPDATE ON SEQUENCE {clocks} TO {names['agent']}")
    # The attempt-log chain trigger draws a fresh id when it must re-lock the effect
    # (outbox_attempts_chain): an explicit nextval needs USAGE on the identity's sequence.
    attempts_seq = f"{schema}.outbox_effect_attempts_id_seq"
    out.append(f"REVOKE ALL ON SEQUENCE {attempts_seq} FROM {every}")
    logging_roles = [
        names[spec.suffix]
        for spec in ROLES
        if "INSERT" in spec.grants.get("outbox_effect_attempts", ())
    ]
    out.append(f"GRANT USAGE ON SEQUENCE {attempts_seq} TO {', '.join(logging_roles)}")
    # Approving a held effect and resuming a paused run are the operator's: the
    # triggers that guard both ask for this function's EXECUTE privilege.
    release = f"{schema}.outbox_may_release()"
    out.append(f"REVOKE ALL ON FUNCTION {release} FROM PUBLIC, {every}")
    out.append(f"GRANT EXECUTE ON FUNCTION {release} TO {names['operator']}")
    # The trigger that checks and holds a stored value runs as the tables' owner: a
    # login that could attach it to a table of its own would hold values through it.
    blobs_written = f"{schema}.outbox_blobs_written()"
    out.append(f"REVOKE ALL ON FUNCTION {blobs_written} FROM PUBLIC, {every}")
    # Which deliverers hold anything in any namespace, read as the tables' owner:
    # for the roles that unregister gone ones, no one else.
    holding = f"{schema}.outbox_owners_holding(text[])"
    owners = [spec for spec in ROLES if "DELETE" in spec.grants.get("outbox_owners", ())]
    forgetters = ", ".join(names[spec.suffix] for spec in owners)
    out.append(f"REVOKE ALL ON FUNCTION {holding} FROM PUBLIC, {every}")
    out.append(f"GRANT EXECUTE ON FUNCTION {holding} TO {forgetters}")
    # The step writers run as the tables' owner: the agent's, no one else's.
    writers = ", ".join(f"{schema}.{w}" for w in STEP_WRITERS)
    out.append(f"REVOKE ALL ON FUNCTION {writers} FROM PUBLIC, {every}")
    out.append(f"GRANT EXECUTE ON FUNCTION {writers} TO {names['agent']}")
    out.extend(role_policies(prefix, schema, names, namespace))
    return out


def apply_roles(
    engine: Engine, prefix: str = "outbox_", schema: str = "public", namespace: str | None = None
) -> list[str]:
    """Create or update the roles in one transaction; returns the role names."""
    statements = role_script(prefix, schema, namespace)
    with translate_errors("creating roles"), engine.begin() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        for statement in statements:
            # As written: no parameters, so ``%`` in format() stays as it is.
            driver.execute(statement)
    return [f"{prefix}{spec.suffix}" for spec in ROLES]


def _shown(table: str, privilege: str) -> str:
    """A privilege as the docs show it: an INSERT of all columns but a few names those few."""
    if not privilege.startswith("INSERT ("):
        return privilege
    granted = {c.strip() for c in privilege[len("INSERT (") : -1].split(",")}
    left_out = [c.name for c in metadata.tables[table].columns if c.name not in granted]
    return f"INSERT (every column but {', '.join(left_out)})"


def grants_markdown(prefix: str = "outbox_") -> str:
    """The grants as Markdown tables, one per role.

    docs/howto/secure-a-deployment.md shows exactly this (a test checks).
    """
    parts = []
    for spec in ROLES:
        rows = [
            f"| `{table}` | {', '.join(_shown(table, p) for p in privileges)} |"
            for table, privileges in spec.grants.items()
            if privileges != ("SELECT",)
        ]
        head = f"**`{prefix}{spec.suffix}`**: {spec.purpose}. SELECT on every outbox table"
        if rows:
            parts.append(f"{head}, and:\n\n| table | privileges |\n|---|---|\n" + "\n".join(rows))
        else:
            parts.append(head + ".")
    return "\n\n".join(parts) + "\n"
