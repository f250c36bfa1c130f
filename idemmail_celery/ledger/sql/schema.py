"""The SQL ledger's tables, as SQLAlchemy definitions and as the numbered migration scripts in
``ledger/migrations/`` (one per step of :data:`MIGRATIONS`, written by :func:`schema_sql`)."""

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
    """The ledger table as it is now, or as migration ``step`` left it (before step 5 without its columns)."""
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
    """The columns migration 005 adds: ``mark`` and ``resolution`` (JSON) and ``writes_ahead`` (NULL: false)."""
    return (sa.Column("mark", sa.Text, nullable=True), sa.Column("resolution", LONG_TEXT, nullable=True),
            sa.Column("writes_ahead", sa.Boolean, nullable=True))


def _record_fields_step(name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> tuple[sa.Table, list[str]]:
    table = ledger_table(name, metadata)
    return table, [c.name for c in record_fields()]


def hops_table(ledger_name: str = DEFAULT_TABLE, metadata: sa.MetaData | None = None) -> sa.Table:
    """The reschedule marks of :meth:`SQLLedger.mark_hop`: ``<ledger_name>_hops``, keyed by a digest."""
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
    """The key-secret roster of :meth:`SQLLedger.announce`: ``<ledger_name>_roster``, one row per live worker."""
    name = f"{ledger_name}_roster"
    return sa.Table(
        name,
        metadata if metadata is not None else sa.MetaData(),
        sa.Column("member", sa.String(MAX_MEMBER_LENGTH), primary_key=True),
        sa.Column("secret_ids", sa.String(MAX_SECRET_IDS_LENGTH), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )


def listing_index(table: sa.Table) -> sa.Index:
    """The index the review queue's keyset pages walk: state, then ``updated_at``, then key. Added to ``table``."""
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
    """The SQL script of migration ``step`` (:data:`MIGRATIONS`) for ``dialect`` (postgresql, mysql or sqlite)."""
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
