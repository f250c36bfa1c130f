"""What the bench leaves on the shared services, removed: its Redis keys and its SQL tables."""

from __future__ import annotations

from typing import Any


def delete_matching(client: Any, *patterns: str) -> None:
    """Delete every key of ``client`` matching one of ``patterns`` (``SCAN``, then ``DEL`` 500 at a time)."""
    names = [name for pattern in patterns for name in client.scan_iter(pattern, count=1000)]
    for i in range(0, len(names), 500):
        client.delete(*names[i:i + 500])


def run_sql(url: str, *statements: str) -> None:
    """Run ``statements`` on the database at ``url`` in one transaction (the bench's own tables, made or dropped)."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        engine.dispose()


def dropped(tables: list[str]) -> list[str]:
    """The statements that drop the bench's ``tables``, each with the SQL ledger's hops table beside it."""
    return [f'DROP TABLE IF EXISTS "{name}"' for t in tables for name in (f"{t}_hops", t)]
