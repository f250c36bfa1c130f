"""Ledger round trips on the hot paths, counted on the wire: the figures the README quotes.

Redis: each command sent alone, and each pipeline, is one round trip; SQL: each statement.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from redis.connection import AbstractConnection
from sqlalchemy import event

from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger
from idemmail_celery.ledger.redis import RedisLedger
from idemmail_celery.ledger.sql import SQLLedger
from idemmail_celery.testing.statements import count_statements

# backend -> (first send: claim + complete, duplicate: claim that finds sent)
EXPECTED = {"redis": (2, 1), "valkey": (2, 1), "postgresql": (2, 1), "mariadb": (2, 1), "sqlite": (2, 2)}


class Counter:
    """Counts commands the store executed for this ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.calls = 0
        self._undo: Any = lambda: None
        if isinstance(ledger, RedisLedger):
            ledger.ping()  # the store check runs once, outside the count
            # On the wire: every packed write to a server is one round trip (a command, or a whole
            # pipeline), whichever path sent it (redis-py's client or the ledger's own connections).
            send = AbstractConnection.send_packed_command

            def counting(conn: Any, *args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return send(conn, *args, **kwargs)

            self._undo = lambda: setattr(AbstractConnection, "send_packed_command", send)
            AbstractConnection.send_packed_command = counting  # type: ignore[method-assign]
        if isinstance(ledger, SQLLedger):
            # At the driver, on every connection the ledger opens from now on: a SQLAlchemy statement
            # listener would turn the ledger's first-send statements back to SQLAlchemy's execute().
            ledger.close()
            event.listen(ledger.engine, "connect", self._count_statements_of)
            ledger.ping()  # connect and create the table outside the count
            assert not ledger.engine._has_events  # the path measured is the one workers take

    def _on_sql(self, *_: Any) -> None:
        self.calls += 1

    def _count_statements_of(self, dbapi_conn: Any, _record: Any) -> None:
        count_statements(dbapi_conn, self._on_sql)

    def count(self) -> int:
        """Requests sent to the store (SQL statements; Redis commands, a script call being one)."""
        return self.calls


@pytest.fixture
def counted(ledger: Ledger) -> Iterator[tuple[Ledger, Counter]]:
    counter = Counter(ledger)
    try:
        yield ledger, counter
    finally:
        counter._undo()


def test_round_trips_per_path(counted: tuple[Ledger, Counter], request: pytest.FixtureRequest) -> None:
    ledger, counter = counted
    backend = request.node.callspec.params["ledger"]
    req = ClaimRequest(key="rt", task_name="t", payload="{}", fingerprint="f" * 64)
    warm = ledger.claim(ClaimRequest(key="warm", task_name="t", payload="{}", fingerprint="f" * 64))
    ledger.complete("warm", warm.token, {"message_id": "m"})  # every script counted below loaded (a fresh server)
    before = counter.count()
    claim = ledger.claim(req)
    ledger.complete("rt", claim.token, {"message_id": "m"})
    first = counter.count() - before

    before = counter.count()
    dup = ledger.claim(req)
    duplicate = counter.count() - before

    assert claim.status is ClaimStatus.ACQUIRED and dup.status is ClaimStatus.DONE
    assert (first, duplicate) == EXPECTED[backend]


def test_bulk_claims_take_few_round_trips(counted: tuple[Ledger, Counter], request: pytest.FixtureRequest) -> None:
    ledger, counter = counted
    reqs = [ClaimRequest(key=f"bulk{i}", task_name="t", payload="{}", fingerprint="f" * 64) for i in range(1000)]
    before = counter.count()
    claims = [c for i in range(0, 1000, 250) for c in ledger.claim_many(reqs[i:i + 250])]
    used = counter.count() - before
    assert all(c.status is ClaimStatus.ACQUIRED for c in claims)
    # 4 batches of 250: a Redis pipeline each, SQL one multi-row insert each.
    assert 4 <= used <= 8, used
