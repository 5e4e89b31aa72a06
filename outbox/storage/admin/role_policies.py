"""The row-level security policies ``outbox roles`` writes (outbox.storage.admin.roles).

Every policy is permissive, each letting a role through on its own conditions:
Citus 14.0.1 creates a restrictive policy on the shards as a permissive one,
where it would restrict nothing (on a cluster, an agent login inserted an
effect already ``succeeded`` until migration 0038).

- ``outbox_effects`` inserts of each prefix's agent, deliverer and operator
  roles: fresh intents and declared compensations only (``<prefix>intents``,
  checked by functions/insert_checks.sql);
- each prefix's roles: every row of every run-scoped table (``<prefix>rows``,
  one policy a command), or with ``--namespace`` the namespace's rows only;
- roles of a deployment's own: every row (``outbox_every_row``), but a session
  confined to a namespace gets nothing from them, and inserts into
  ``outbox_effects`` are left to the intents policies of the roles that have one.
"""

from __future__ import annotations

from outbox.models import EffectStatus
from outbox.storage.sql.common import sql_in

__all__ = ["CONFINED", "CONFINED_TABLES", "role_policies"]

#: The role every role confined to a namespace is in (whatever its prefix): the
#: policies that let other roles at every row leave its members out.
CONFINED = "outbox_confined"

# What a login confined to a namespace may touch of each run-scoped table: the
# namespace's rows, its runs', its effects'. (A constant in the policy: a column
# compared with it costs nothing; a row that names only its run costs a lookup.)
CONFINED_TABLES = {
    "outbox_runs": "namespace = {ns}",
    "outbox_effects": "namespace = {ns}",
    "outbox_run_keys": "namespace = {ns}",
    "outbox_effect_keys": "namespace = {ns}",
    "outbox_steps": "{schema}.outbox_row_in_namespace('outbox_runs', shard, run_id, {ns})",
    "outbox_signals": "{schema}.outbox_row_in_namespace('outbox_runs', shard, run_id, {ns})",
    "outbox_budget_ledger": "{schema}.outbox_row_in_namespace('outbox_runs', shard, run_id, {ns})",
    "outbox_effect_attempts": (
        "{schema}.outbox_row_in_namespace('outbox_effects', shard, effect_id, {ns})"
    ),
    # Large values, stored once for every namespace that stores the same text: the
    # uses of its runs and run-less effects, the values they use, and what its own
    # transaction wrote (written_in: its mark, set by a trigger; a run's inputs are
    # stored before the run is). Another namespace's value is named by its sha256
    # in no row the login can read.
    "outbox_blob_refs": (
        "{schema}.outbox_written_here(written_in)"
        " OR {schema}.outbox_row_in_namespace('outbox_runs', shard, owner, {ns})"
        " OR {schema}.outbox_row_in_namespace('outbox_effects', shard, owner, {ns})"
    ),
    "outbox_blobs": (
        "{schema}.outbox_written_here(written_in)"
        " OR {schema}.outbox_blob_in_namespace(shard, sha256, {ns})"
    ),
}
_OLD_CHECKS = (
    "outbox_is_declared_compensation(uuid, uuid, text, jsonb)",
    "outbox_gates_clear(text, jsonb, text, jsonb)",
    "outbox_run_takes_intent(uuid, text)",
)


def role_policies(
    prefix: str, schema: str, names: dict[str, str], namespace: str | None
) -> list[str]:
    """The statements that bring the policies of one prefix's roles (``names``) up to date."""
    out: list[str] = []
    # Who may insert into outbox_effects, and what (functions/insert_checks.sql).
    effects = f"{schema}.outbox_effects"
    # An intent commits pending, held by an approval gate (awaiting_approval), or
    # paused for a paused run's step (outbox.runs.control).
    intended = (EffectStatus.PENDING, EffectStatus.AWAITING_APPROVAL, EffectStatus.PAUSED)
    fresh = (
        f"{sql_in('status', intended)} "
        "AND attempt = 0 AND lease_owner IS NULL AND result IS NULL "
        "AND completed_at IS NULL AND awaited_by IS NULL"
    )
    # (Functions of the row's columns, not expressions in the policy: Citus cannot
    # propagate a policy with a sub-select or a nested call.)
    gated = f"{schema}.outbox_intent_gated(kind, payload, status, approval, shard)"
    # (an effect is its run's namespace's: of another, it would be written into the
    # record of a run its login may not see)
    of_live_run = f"{schema}.outbox_intent_of_live_run(run_id, status, namespace)"
    declared = (
        f"{schema}.outbox_compensation_declared(compensates, run_id, kind, payload, namespace)"
    )
    # (one policy per prefix: another prefix's roles keep theirs)
    intents = f"{prefix}intents"
    own_namespace = "" if namespace is None else f" AND namespace = '{namespace}'"
    out.append(f"DROP POLICY IF EXISTS {intents} ON {effects}")
    out.append(
        f"CREATE POLICY {intents} ON {effects} AS PERMISSIVE FOR INSERT "
        f"TO {names['agent']}, {names['deliverer']}, {names['operator']}\n"
        f"WITH CHECK ({fresh} AND {gated}{own_namespace} AND (\n"
        f"    (compensates IS NULL AND pg_has_role(current_user, '{names['agent']}', 'USAGE')\n"
        f"     AND {of_live_run})\n"
        f"    OR (compensates IS NOT NULL AND {declared})))"
    )
    # the checks' functions `outbox roles` made before migration 0038
    for old in _OLD_CHECKS:
        out.append(
            f"DO $$ BEGIN DROP FUNCTION IF EXISTS {schema}.{old}; "
            "EXCEPTION WHEN insufficient_privilege OR dependent_objects_still_exist THEN NULL;"
            " END $$"
        )
    # (an UPDATE policy of 0035 before its release; outbox_effects_hold_paused does it)
    out.append(f"DROP POLICY IF EXISTS outbox_ended_effects ON {effects}")
    out.extend(_every_row(schema))
    out.extend(_confinement(prefix, schema, names, namespace))
    return out


def _every_row(schema: str) -> list[str]:
    """Every run-scoped table's policies for roles of a deployment's own.

    They see, change and delete every row, as without row-level security; they
    insert every row but into ``outbox_effects``, where the agents', deliverers'
    and operators' inserts are checked (the intents policy of each prefix). A
    role confined to a namespace (in ``CONFINED``) gets nothing from them: once
    such a role exists they ask ``pg_has_role``, a cached lookup, of each row;
    until then they are the constant ``true``. The roles of ``outbox roles``
    have policies of their own, which PostgreSQL folds these into when theirs
    is ``true``.
    """
    free = f"NOT pg_catalog.pg_has_role(current_user, ''{CONFINED}'', ''USAGE'')"
    checked = f"{schema}.outbox_session_inserts_checked()"
    out = []
    for table in CONFINED_TABLES:
        target = f"{schema}.{table}"
        out.append(f"ALTER TABLE {target} ENABLE ROW LEVEL SECURITY")
        creates = []
        for command, using, check in (
            ("SELECT", True, False),
            ("UPDATE", True, True),
            ("DELETE", True, False),
            ("INSERT", False, True),
        ):
            name = _policy("outbox_every_row", command)
            inserts = command == "INSERT" and table == "outbox_effects"
            creates.append(
                f"    DROP POLICY IF EXISTS {name} ON {target};\n"
                f"    EXECUTE format('CREATE POLICY {name} ON {target} AS PERMISSIVE FOR {command}"
                " TO PUBLIC"
                + (" USING (%1$s)" if using else "")
                + (
                    " WITH CHECK (%1$s" + (f" AND NOT {checked}" if inserts else "") + ")"
                    if check
                    else ""
                )
                + "', free);"
            )
        out.append(
            "DO $$\nDECLARE\n"
            f"    free text := CASE WHEN to_regrole('{CONFINED}') IS NULL THEN 'true'\n"
            f"                      ELSE '{free}' END;\n"
            "BEGIN\n" + "\n".join(creates) + "\nEND $$"
        )
    return out


def _one_namespace(role: str, namespace: str) -> str:
    """Refuse to confine ``role`` to ``namespace`` when it is confined to another.

    (Two namespaces can make one role prefix: ``a.b`` and ``a-b`` both
    ``outbox_a_b_``; the second would move the first one's logins.)
    """
    return (
        "DO $$ BEGIN\n"
        "    IF EXISTS (SELECT FROM pg_db_role_setting AS s, unnest(s.setconfig) AS c(setting)\n"
        f"                WHERE s.setrole = to_regrole('{role}')\n"
        "                  AND c.setting LIKE 'outbox.namespace=%'\n"
        f"                  AND c.setting <> 'outbox.namespace={namespace}') THEN\n"
        f"        RAISE EXCEPTION 'role {role} is confined to another namespace than {namespace}'\n"
        "            USING ERRCODE = 'invalid_parameter_value',\n"
        "                  HINT = 'give this namespace its own role names: --prefix';\n"
        "    END IF;\n"
        "END $$"
    )


def _policy(name: str, command: str) -> str:
    """A policy's name for one command (SELECT keeps the bare name, as before 0038)."""
    return name if command == "SELECT" else f"{name}_{command.lower()}"


def _confinement(
    prefix: str, schema: str, names: dict[str, str], namespace: str | None
) -> list[str]:
    """Confine the four roles to ``namespace`` (or free them of any, when None).

    Every run-scoped table gets a policy per command for the four: every row,
    or when confined a row of the namespace, or of one of its runs or effects.
    Their inserts into ``outbox_effects`` are the intents policy's, which names
    the namespace too. Confined, each carries the role setting
    ``outbox.namespace`` (read from the catalog by the step writers and by the
    policies for other roles, which so leave it out: functions/namespaces.sql).
    (Setting a role's settings takes CREATEROLE; freeing roles that carry none
    takes nothing.)
    """
    roles = ", ".join(names.values())
    out = []
    for role in names.values():
        if namespace is not None:
            out.append(_one_namespace(role, namespace))
            out.append(f"ALTER ROLE {role} SET outbox.namespace = '{namespace}'")
            out.append(f"GRANT {CONFINED} TO {role}")
        else:
            out.append(
                "DO $$ BEGIN\n"
                "    IF EXISTS (SELECT FROM pg_auth_members AS m\n"
                f"                WHERE m.roleid = to_regrole('{CONFINED}')\n"
                f"                  AND m.member = to_regrole('{role}')) THEN\n"
                f"        REVOKE {CONFINED} FROM {role};\n"
                "    END IF;\n"
                "END $$"
            )
            out.append(
                "DO $$ BEGIN\n"
                "    IF EXISTS (SELECT FROM pg_db_role_setting AS s JOIN pg_roles AS r\n"
                f"                 ON r.oid = s.setrole WHERE r.rolname = '{role}'\n"
                "                AND s.setconfig::text LIKE '%outbox.namespace=%') THEN\n"
                f"        ALTER ROLE {role} RESET outbox.namespace;\n"
                "    END IF;\n"
                "END $$"
            )
    for table, of_namespace in CONFINED_TABLES.items():
        target = f"{schema}.{table}"
        # (true: a constant, so the free roles' policies, ORed with it, are never run)
        check = (
            "true" if namespace is None else of_namespace.format(schema=schema, ns=f"'{namespace}'")
        )
        for command in ("SELECT", "UPDATE", "DELETE", "INSERT"):
            policy = _policy(f"{prefix}rows", command)
            out.append(f"DROP POLICY IF EXISTS {policy} ON {target}")
            if command == "INSERT" and table == "outbox_effects":
                continue
            using = "" if command == "INSERT" else f" USING ({check})"
            with_check = f" WITH CHECK ({check})" if command in ("UPDATE", "INSERT") else ""
            out.append(
                f"CREATE POLICY {policy} ON {target} AS PERMISSIVE FOR {command} "
                f"TO {roles}{using}{with_check}"
            )
    return out
