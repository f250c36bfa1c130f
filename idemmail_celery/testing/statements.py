"""Counting the SQL statements a ledger sends, at the driver (why not with a SQLAlchemy listener: docs/testing.md)::

    event.listen(ledger.engine, "connect", lambda conn, _record: count_statements(conn, bump))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def count_statements(dbapi_conn: Any, on_statement: Callable[..., object]) -> None:
    """Call ``on_statement()`` for every statement ``dbapi_conn`` runs from now on.

    sqlite3 by its trace callback; psycopg 3 (``cursor_factory``) and PyMySQL
    (``cursorclass``) by a cursor class that counts ``execute()``.
    """
    if hasattr(dbapi_conn, "set_trace_callback"):  # sqlite3
        dbapi_conn.set_trace_callback(on_statement)
        return
    attr = "cursor_factory" if hasattr(dbapi_conn, "cursor_factory") else "cursorclass"
    base = getattr(dbapi_conn, attr)

    class CountingCursor(base):  # type: ignore[misc, valid-type]
        def execute(self, *args: Any, **kwargs: Any) -> Any:
            on_statement()
            return super().execute(*args, **kwargs)

    setattr(dbapi_conn, attr, CountingCursor)
