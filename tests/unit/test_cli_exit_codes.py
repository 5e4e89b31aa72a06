"""``outbox``'s exit codes: an error is 1, Ctrl-C is 130 even when stopping then fails."""

from __future__ import annotations

import pytest

import outbox.cli as root
from outbox import OutboxError


def _command_failing(during_interrupt: bool) -> None:
    if not during_interrupt:
        raise OutboxError("the database refused")
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        # psycopg's cancel of the interrupted query landed on the next statement,
        # the one that stops the command's children.
        raise OutboxError("canceling statement due to user request") from None


@pytest.mark.parametrize(
    ("during_interrupt", "code", "said"), [(False, 1, "error: "), (True, 130, "aborted")]
)
def test_an_error_raised_while_stopping_after_ctrl_c_is_an_abort(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    during_interrupt: bool,
    code: int,
    said: str,
) -> None:
    monkeypatch.setattr(root.cli, "main", lambda **_: _command_failing(during_interrupt))
    monkeypatch.setattr("sys.argv", ["outbox", "demo"])
    with pytest.raises(SystemExit) as exited:
        root.main()
    assert exited.value.code == code
    assert said in capsys.readouterr().err
