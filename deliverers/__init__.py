"""Deliverers: one module per kind of sink, found through the ``outbox.deliverers`` entry points."""

from __future__ import annotations

__all__: list[str] = []
