"""The SQL ledger's schema through Alembic (the ``migrations`` extra): each revision in ``revisions/versions/`` runs
one step of :data:`~.schema.MIGRATIONS`, recorded in ``<table>_alembic``; a ledger made without Alembic is adopted
at the revision its schema shows. ``celery -A proj idemmail ledger migrate [--to REV | --down-to REV]``, or::

    migrate.upgrade("postgresql+psycopg://.../app")            # to the newest revision
    migrate.downgrade("postgresql+psycopg://.../app", "0004")  # one step back: drops the step 5 columns
    migrate.current("postgresql+psycopg://.../app")            # "0005"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ...errors import ConfigurationError
from .schema import DEFAULT_TABLE, MIGRATIONS, record_fields

#: Revision ids: ``"0001"`` ... one per step of :data:`~.schema.MIGRATIONS`.
REVISIONS = tuple(f"{n:04d}" for n in range(1, len(MIGRATIONS) + 1))
HEAD = REVISIONS[-1]


def revision_of(step: int) -> str:
    """The Alembic revision id of migration ``step`` (1-based)."""
    return REVISIONS[step - 1]


def _alembic() -> Any:
    try:
        import alembic.command
        import alembic.config
    except ImportError as exc:  # pragma: no cover - the extra is part of the test install
        raise ConfigurationError("migrations need Alembic: pip install 'idemmail-celery[migrations]'") from exc
    return alembic


def _config(conn: Connection, table: str) -> Any:
    alembic = _alembic()
    cfg = alembic.config.Config()
    cfg.set_main_option("script_location", "idemmail_celery.ledger.sql:revisions")
    cfg.attributes["connection"] = conn
    cfg.attributes["idemmail_table"] = table
    return cfg


@contextmanager
def _connected(url: str | sa.Engine) -> Iterator[Connection]:
    engine = sa.create_engine(url) if isinstance(url, str) else url
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        if isinstance(url, str):
            engine.dispose()


def version_table(table: str = DEFAULT_TABLE) -> str:
    """Where the revision of the ledger ``table`` is kept."""
    return f"{table}_alembic"


def upgrade(url: str | sa.Engine, revision: str = "head", *, table: str = DEFAULT_TABLE) -> str:
    """Bring the ledger ``table`` at ``url`` up to ``revision`` (the newest by default); returns the revision."""
    return _move("upgrade", url, revision, table)


def downgrade(url: str | sa.Engine, revision: str, *, table: str = DEFAULT_TABLE) -> str:
    """Take ``table`` back to ``revision``, dropping what each step added (``"base"``: all, records too)."""
    return _move("downgrade", url, revision, table)


def _move(command: str, url: str | sa.Engine, revision: str, table: str) -> str:
    alembic = _alembic()
    with _connected(url) as conn:
        _adopt(conn, table)
        getattr(alembic.command, command)(_config(conn, table), revision)
        return _current(conn, table) or "base"


def current(url: str | sa.Engine, *, table: str = DEFAULT_TABLE) -> str | None:
    """The revision the ledger ``table`` is at as Alembic recorded it; None when it has recorded none."""
    with _connected(url) as conn:
        return _current(conn, table)


def _current(conn: Connection, table: str) -> str | None:
    if not sa.inspect(conn).has_table(version_table(table)):
        return None
    row = conn.execute(sa.text(f"SELECT version_num FROM {version_table(table)}")).first()
    return None if row is None else str(row[0])


def _made(step: int, table: str) -> Any:
    """What migration ``step`` makes for ``table``: a table, an index, or a table and the columns it adds."""
    return MIGRATIONS[step - 1][2](table)


def applied_steps(conn: Connection, table: str = DEFAULT_TABLE) -> int:
    """How many steps of :data:`~.schema.MIGRATIONS` the schema at ``conn`` shows, counted from the first."""
    inspector = sa.inspect(conn)
    steps = 0
    for n in range(1, len(MIGRATIONS) + 1):
        made = _made(n, table)
        if isinstance(made, tuple):
            there = set(made[1]) <= {c["name"] for c in inspector.get_columns(table)}
        elif isinstance(made, sa.Index):
            there = any(ix.get("name") == made.name for ix in inspector.get_indexes(table))
        else:
            there = inspector.has_table(made.name)
        if not there:
            break
        steps = n
    return steps


def step(n: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """The ``upgrade`` and ``downgrade`` of the Alembic revision of migration ``n``."""
    return (lambda: apply_step(n)), (lambda: revert_step(n))


def apply_step(step: int) -> None:
    """Run migration ``step`` inside an Alembic revision, on the ledger's table."""
    from alembic import context, op

    table = context.config.attributes["idemmail_table"]
    made = _made(step, table)
    if isinstance(made, tuple):
        for column in record_fields():
            if column.name in made[1]:
                op.add_column(table, column)
    else:
        made.create(op.get_bind())


def revert_step(step: int) -> None:
    """Undo migration ``step`` inside an Alembic revision: drop what it made."""
    from alembic import context, op

    table = context.config.attributes["idemmail_table"]
    made = _made(step, table)
    if isinstance(made, tuple):
        with op.batch_alter_table(table) as batch:  # SQLite: the table is rebuilt without the columns
            for name in made[1]:
                batch.drop_column(name)
    elif isinstance(made, sa.Index):
        op.drop_index(str(made.name), table_name=table)
    else:
        op.drop_table(made.name)


def _adopt(conn: Connection, table: str) -> None:
    """Write down the revision of a ledger whose schema came without Alembic."""
    if _current(conn, table) is not None:
        return
    steps = applied_steps(conn, table)
    if steps:
        _alembic().command.stamp(_config(conn, table), revision_of(steps))
