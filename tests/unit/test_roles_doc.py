"""The roles: their SQL is built from checked names, and the docs show exactly their grants."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox import ValidationError
from outbox.storage.admin.roles import ROLES, grants_markdown, role_script
from outbox.storage.schema import metadata

ROOT = Path(__file__).resolve().parents[2]


def test_docs_show_the_grants() -> None:
    doc = (ROOT / "docs" / "howto" / "secure-a-deployment.md").read_text()
    begin = doc.index("<!-- grants:begin")
    block = doc[doc.index("\n", begin) + 1 : doc.index("<!-- grants:end -->")]
    assert block == grants_markdown()


def test_every_role_reads_every_table_and_only_the_agent_writes_runs() -> None:
    for spec in ROLES:
        assert set(spec.grants) == set(metadata.tables), spec.suffix
        assert all("SELECT" in privileges for privileges in spec.grants.values())
    inserting_runs = [
        s.suffix for s in ROLES if any(p.startswith("INSERT") for p in s.grants["outbox_runs"])
    ]
    assert inserting_runs == ["agent"]
    reader = next(s for s in ROLES if s.suffix == "reader")
    assert all(privileges == ("SELECT",) for privileges in reader.grants.values())


@pytest.mark.parametrize("prefix", ["x; DROP TABLE y", "Outbox_", "a-b", ""])
def test_names_that_are_not_plain_identifiers_are_refused(prefix: str) -> None:
    with pytest.raises(ValidationError, match="prefix"):
        role_script(prefix)
    with pytest.raises(ValidationError, match="schema"):
        role_script("outbox_", schema='public"; --')
