"""``outbox roles``: create or update the least-privilege roles, or print their SQL."""

from __future__ import annotations

import click

from outbox.cli._common import CliContext, console, emit, json_option, pass_cli, table
from outbox.cli.reports import RoleLine, RolesReport

__all__ = ["COMMANDS"]

ROLES_HELP = """Create or update the agent, deliverer, operator and reader roles and their grants.

    \b
    outbox_agent      start runs, commit steps and intents, signals; no completion
    outbox_deliverer  claim, heartbeat, complete, reconcile, move stopping runs on;
                      no intents (only the compensations agents declared)
    outbox_operator   resolve, retry, cancel, reconcile, gc; no intents
    outbox_reader     read everything
    Group roles without LOGIN: give each login one of them, e.g.
      CREATE ROLE billing_agent LOGIN PASSWORD '...' IN ROLE outbox_agent;
    With --namespace NS, the four roles (outbox_NS_agent, ...) are confined to
    NS: their logins see and change only NS's runs, effects and what belongs to them.
    Run as the owner of the outbox tables (or a superuser); running it again
    brings the grants back to exactly these. docs/howto/secure-a-deployment.md shows them.
    """


@click.command("roles", help=ROLES_HELP)
@click.option(
    "--prefix",
    default=None,
    help="Role names start with this (roles belong to the whole server, not one database)."
    "  [default: outbox_, or outbox_NS_ with --namespace NS]",
)
@click.option(
    "--namespace",
    default=None,
    metavar="NS",
    help="Confine the roles to this namespace (Settings.namespace of the clients that use them).",
)
@click.option(
    "--schema",
    default="public",
    show_default=True,
    help="The schema the outbox tables live in.",
)
@click.option(
    "--print",
    "print_only",
    is_flag=True,
    help="Print the SQL instead of running it (to review, or to run with psql).",
)
@json_option(RolesReport)
@pass_cli
def roles(
    cli: CliContext,
    prefix: str | None,
    namespace: str | None,
    schema: str,
    print_only: bool,
    as_json: bool,
) -> None:
    """Create or update the agent, deliverer, operator and reader roles and their grants."""
    from outbox.storage.admin.roles import ROLES, apply_roles, namespace_prefix, role_script

    if prefix is None:
        prefix = "outbox_" if namespace is None else namespace_prefix(namespace)
    if print_only:
        for statement in role_script(prefix, schema, namespace):
            click.echo(statement + ";\n")
        return
    with console.status("granting…"):
        names = apply_roles(cli.outbox.engine, prefix, schema, namespace)
    report = RolesReport(
        roles=[
            RoleLine(role=name, purpose=spec.purpose)
            for name, spec in zip(names, ROLES, strict=True)
        ],
        namespace=namespace,
    )
    emit(
        report,
        as_json,
        lambda: table("roles", ["role", "purpose"], [(r.role, r.purpose) for r in report.roles]),
    )


COMMANDS = [roles]
