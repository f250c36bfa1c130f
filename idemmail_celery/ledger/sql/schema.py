"""The SQL ledger's tables, as SQLAlchemy definitions and as the numbered migration scripts.

:class:`~idemmail_celery.ledger.sql.SQLLedger` creates the tables on first use; ``ledger/migrations/``
holds the same DDL per dialect, one numbered file per step (:data:`MIGRATIONS`), for teams that apply
schema changes themselves: :func:`schema_sql` writes each, and a test keeps the files in step with it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from ..base import MAX_MEMBER_LENGTH, MAX_SECRET_IDS_LENGTH

DEFAULT_TABLE = "idemmail_ledger"
#: Text without a length limit: MariaDB's TEXT stops at 64 KiB.
LONG_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
_HOP_DIGEST_BYTES = 16


def hop_digest(key: str, hop: str) -> str:
    """The name a reschedule's mark is stored under: a digest of key and hop, never either."""
    return hashlib.blake2b(f"{key}\0{hop}".encode(), digest_size=_HOP_DIGEST_BYTES).hexdigest()


def ledger_table(name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None, *, step: int = 0) -> sa.Table:
    """The ledger table definition (also used to generate ``ledger/migrations/``): as it is now, or as migration
    ``step`` left it (step 1 made it without the columns step 5 adds)."""
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("intent_key", sa.String(128), primary_key=True),
        sa.Column("task_name", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("token", sa.BigInteger, nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("lease_expires_at", sa.Double, nullable=True),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("reclaims", sa.Integer, nullable=False),
        sa.Column("payload", LONG_TEXT, nullable=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("result", LONG_TEXT, nullable=True),
        sa.Column("error", LONG_TEXT, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=True),
        *(record_fields() if not 0 < step < 5 else ()),
        sa.Index(f"ix_{name}_state", "state"),
        sa.Index(f"ix_{name}_expires_at", "expires_at"),
    )


def record_fields() -> tuple[sa.Column[Any], ...]:
    """The columns migration 005 adds, each a field of its own: the write-ahead mark (``Record.mark``, JSON) and the
    operator's decision (``Record.resolution``, JSON), which once shared ``error``, and the holder's promise of
    marks (``Record.writes_ahead``; NULL reads as false), which was a flag inside the owner string."""
    return (sa.Column("mark", sa.Text, nullable=True), sa.Column("resolution", LONG_TEXT, nullable=True),
            sa.Column("writes_ahead", sa.Boolean, nullable=True))


def _record_fields_step(name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> tuple[sa.Table, list[str]]:
    table = ledger_table(name, metadata)
    return table, [c.name for c in record_fields()]


def hops_table(ledger_name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Table:
    """The reschedule marks kept by :meth:`SQLLedger.mark_hop`: ``<ledger_name>_hops``.

    One row per (intent key, hop): a digest of the two (never the key or the task id
    itself), a nonce telling the caller whether its own write landed, and an expiry.
    """
    name = f"{ledger_name}_hops"
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("digest", sa.String(_HOP_DIGEST_BYTES * 2), primary_key=True),
        sa.Column("marker", sa.String(16), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.Index(f"ix_{name}_expires_at", "expires_at"),
    )


def roster_table(ledger_name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Table:
    """The key-secret roster kept by :meth:`SQLLedger.announce`: ``<ledger_name>_roster``, one row per
    live worker (its ``host:pid``, the ids of the key secrets it holds, when the row lapses)."""
    name = f"{ledger_name}_roster"
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("member", sa.String(MAX_MEMBER_LENGTH), primary_key=True),
        sa.Column("secret_ids", sa.String(MAX_SECRET_IDS_LENGTH), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )


def listing_index(table: sa.Table) -> sa.Index:
    """The index the review queue's pages walk (:meth:`SQLLedger.list_records`): the records of one state in
    the order they entered it, ties by key (a keyset page is one range of it). Added to ``table``."""
    return sa.Index(f"ix_{table.name}_listing", table.c.state, table.c.updated_at, table.c.intent_key)


def _listing_step(name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Index:
    return listing_index(ledger_table(name, metadata))


#: The schema, one step per migration file: ``ledger/migrations/00<step>_<name>.<dialect>.sql``.
MIGRATIONS: tuple[tuple[str, str, Any], ...] = (
    ("create_ledger", "ledger table", lambda name: ledger_table(name, step=1)),
    ("create_hops", "reschedule marks table (step 2)", hops_table),
    ("create_roster", "key-secret roster table (step 3)", roster_table),
    ("create_listing_index", "review queue's listing index (step 4)", _listing_step),
    ("add_record_fields", "write-ahead mark, resolution and promise columns (step 5)", _record_fields_step),
)


def schema_sql(dialect: str, table: str = DEFAULT_TABLE, step: int = 1) -> str:
    """The ``CREATE TABLE``/``CREATE INDEX`` script of migration ``step`` for ``dialect``.

    ``dialect`` is postgresql, mysql or sqlite. Step 1 creates the ledger table, step 2
    its reschedule marks (``<table>_hops``, used by :meth:`SQLLedger.mark_hop`), step 3 its
    key-secret roster (``<table>_roster``, :meth:`SQLLedger.announce`), step 4 the index the
    review queue's pages walk (:func:`listing_index`), step 5 the record's ``mark``,
    ``resolution`` and ``writes_ahead`` columns (:func:`record_fields`); a ledger created by an
    earlier version needs only the steps after those it has. ``ledger/migrations/`` holds
    the output for the default table name; a test keeps the two in step.
    """
    from sqlalchemy.schema import CreateIndex, CreateTable

    modules: dict[str, Any] = {"postgresql": postgresql, "mysql": mysql, "sqlite": sqlite}
    d = modules[dialect].dialect()
    _, title, make = MIGRATIONS[step - 1]
    t = make(table)
    if isinstance(t, tuple):  # a step that adds columns to a table an earlier step made
        parts = [add_column_sql(t[0], t[0].c[name], d) for name in t[1]]
    elif isinstance(t, sa.Index):  # a step that adds an index to a table an earlier step made
        parts = [str(CreateIndex(t).compile(dialect=d)).strip()]
    else:
        parts = [str(CreateTable(t).compile(dialect=d)).strip()]
        parts += [str(CreateIndex(ix).compile(dialect=d)).strip()
                  for ix in sorted(t.indexes, key=lambda i: str(i.name))]
    header = f"-- idemmail-celery {title}, {dialect}. Generated by idemmail_celery.ledger.sql.schema_sql.\n"
    return header + ";\n\n".join(parts) + ";\n"


def add_column_sql(table: sa.Table, column: sa.Column[Any], dialect: sa.Dialect) -> str:
    """``ALTER TABLE ... ADD COLUMN`` for ``column`` of ``table`` (a nullable column: no default needed)."""
    from sqlalchemy.schema import CreateColumn

    preparer = dialect.identifier_preparer
    return f"ALTER TABLE {preparer.format_table(table)} ADD COLUMN {CreateColumn(column).compile(dialect=dialect)}"


def migration_file(dialect: str, step: int) -> str:
    """The file name of migration ``step`` for ``dialect`` in ``ledger/migrations/``."""
    return f"{step:03d}_{MIGRATIONS[step - 1][0]}.{dialect}.sql"
