"""Storage: the only package that builds or executes SQL and imports the database driver.

Above it, code calls named methods (``Store``, ``RunTx``, ``AsyncStore``) and
never sees a query. Agents still receive a SQLAlchemy connection for their own
rows (``tx.connection``); its types are re-exported here for annotations.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

__all__ = ["AsyncConnection", "AsyncEngine", "Connection", "Engine"]
