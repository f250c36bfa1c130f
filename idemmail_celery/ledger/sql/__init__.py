"""SQL ledger through SQLAlchemy 2: PostgreSQL, MariaDB/MySQL and SQLite.

One row per intent, keyed by the intent key. The hot path runs in autocommit
with no multi-statement transactions, on a connection kept open between calls:

* claim: ``INSERT ... ON CONFLICT DO NOTHING`` (PostgreSQL, SQLite) or a no-op
  ``ON DUPLICATE KEY UPDATE`` (MariaDB; not ``INSERT IGNORE``, which would hide
  data errors). A new key is claimed in that one statement. Otherwise the row
  is read, and a released claim, an expired lease or a record past retention
  is taken over with one conditional ``UPDATE`` that names the token it saw,
  so two claimers can never both win.
* complete / fail / park / release: one conditional ``UPDATE`` on key, state
  and token.
* mark_hop: one upsert into a small companion table (``<table>_hops``) of
  digests of (key, hop) with an expiry, which replaces an expired mark only.

Lease times use the worker's clock: keep worker clocks in sync (NTP) to well
within the lease. The tables are created on first use; ``ledger/migrations/`` holds the
same DDL per dialect, one numbered file per step, for teams that apply schema
changes themselves.

SQLite is the embedded default: fine for one machine and the demo, with WAL
and a busy timeout so several worker processes can share the file (see
:func:`.connection._ensure_wal` for why the switch to WAL is retried).

Three modules: :mod:`.schema` (the tables and their migration scripts), :mod:`.connection` (the engine,
the schema check, the kept connection, errors as ``LedgerUnavailableError``) and :mod:`.store`
(:class:`SQLLedger`'s moves).
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
