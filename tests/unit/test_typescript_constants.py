"""Constants the TypeScript client repeats from Python stay equal to Python's."""

from __future__ import annotations

import json
import re
from pathlib import Path

from outbox.models import TERMINAL_EFFECT_STATUSES

CLIENT = Path(__file__).parents[2] / "clients" / "typescript" / "src" / "client.ts"


def test_the_terminal_effect_statuses_are_pythons() -> None:
    found = re.search(r"TERMINAL_EFFECT_STATUSES = (\[[^\]]*\]) as const", CLIENT.read_text())
    assert found is not None, "TERMINAL_EFFECT_STATUSES not found in client.ts"
    assert json.loads(found[1]) == [s.value for s in TERMINAL_EFFECT_STATUSES]
