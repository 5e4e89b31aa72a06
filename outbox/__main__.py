"""``python -m outbox`` runs the CLI."""

from __future__ import annotations

from outbox.cli import main

main()
