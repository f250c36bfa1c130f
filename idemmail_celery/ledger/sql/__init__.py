"""SQL ledger through SQLAlchemy 2: PostgreSQL, MariaDB/MySQL and SQLite.

One row per intent; a claim is one upsert, a takeover or transition one ``UPDATE`` fenced by state and token, in
autocommit; lease times use the workers' clocks (keep them in sync). Modules: :mod:`.schema` (tables, migrations),
:mod:`.connection` (engine, schema check, errors) and :mod:`.store` (:class:`SQLLedger`'s moves)."""

from __future__ import annotations

from .connection import SQLITE_BUSY_SECONDS, SQLConnections
from .schema import (
    DEFAULT_TABLE,
    MIGRATIONS,
    hops_table,
    ledger_table,
    listing_index,
    migration_file,
    roster_table,
    schema_sql,
)
from .store import SQLLedger

__all__ = [
    "DEFAULT_TABLE", "MIGRATIONS", "SQLITE_BUSY_SECONDS", "SQLConnections", "SQLLedger", "hops_table",
    "ledger_table", "listing_index", "migration_file", "roster_table", "schema_sql",
]
