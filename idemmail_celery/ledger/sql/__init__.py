"""SQL ledger through SQLAlchemy 2: PostgreSQL, MariaDB/MySQL and SQLite.

One row per intent. A claim is one upsert (the existing row returned), a takeover one conditional ``UPDATE``
naming the token it saw, every transition one conditional ``UPDATE`` on key, state and token; all in
autocommit. Lease times use the workers' clocks: keep them in sync (NTP).

Modules: :mod:`.schema` (tables and migration scripts), :mod:`.connection` (engine, schema check, errors) and
:mod:`.store` (:class:`SQLLedger`'s moves).
"""

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
