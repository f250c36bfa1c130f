"""Every store error out of the SQL ledger is :class:`LedgerUnavailableError` (fail closed), never raw.

Real services, real failures: the connection pool exhausted (its one connection busy in another
thread), the server killing the ledger's connection, a statement cancelled by the server's
timeout while another session holds the row. Each operation a worker makes (claim, claim_many,
complete/fail/park/release, renew, withdraw, mark_hop, hop_marked, _erase) is tried against each, and nothing it
was refused is changed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from idemmail_celery.errors import LedgerUnavailableError
from idemmail_celery.ledger import ClaimStatus, State
from idemmail_celery.ledger.sql import SQLLedger

from .conftest import MARIADB_URL, POSTGRES_URL, drop_ledger, service_missing, unique
from .test_sql_connections import _kill_spare
from .test_sql_connections import request as req

#: An operation on a ledger holding claim "held" (token 1): what a worker does at each step.
OPERATIONS: dict[str, Callable[[SQLLedger], object]] = {
    "claim": lambda led: led.claim(req("new")),
    "claim_many": lambda led: led.claim_many([req("new"), req("new2")]),
    "complete": lambda led: led.complete("held", 1, {"message_id": "m"}),
    "fail": lambda led: led.fail("held", 1, {"reason": "x"}),
    "park": lambda led: led.park("held", 1, {"reason": "x"}),
    "release": lambda led: led.release("held", 1),
    "renew": lambda led: led.renew("held", 1, 60),
    "withdraw": lambda led: led.withdraw("held", 1),
    "mark_hop": lambda led: led.mark_hop("held", "task:1", 60),
    "hop_marked": lambda led: led.hop_marked("held", "task:1"),
    "erase": lambda led: led._erase("held", 1, State.CLAIMED, None, None, None),
}
#: Those that write the "held" row (a lock on it makes them wait).
ROW_WRITERS = ["complete", "fail", "park", "release", "renew", "withdraw", "erase"]


def _url(dialect: str, tmp_path: Path) -> str:
    return {"postgresql": POSTGRES_URL, "mariadb": MARIADB_URL}.get(dialect) or f"sqlite:///{tmp_path / 'l.sqlite3'}"


def _open(url: str, dialect: str, **options: Any) -> SQLLedger:
    led = SQLLedger(url, table=unique("err"), **options)
    try:
        led.ping()
    except Exception as exc:
        service_missing(dialect, exc)
    return led


def _untouched(led: SQLLedger) -> None:
    """The claim every test holds is as it was: claimed, token 1, payload kept; nothing new."""
    held = led.get("held")
    assert held is not None and held.state is State.CLAIMED and held.token == 1
    assert held.payload is not None and held.result is None
    assert led.get("new") is None and led.get("new2") is None


@pytest.fixture(params=["postgresql", "mariadb", "sqlite"])
def one_connection(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[SQLLedger, threading.Event]]:
    """A ledger whose pool holds one connection, held by another thread until the event is set."""
    led = _open(_url(request.param, tmp_path), request.param, pool_size=1, max_overflow=0, pool_timeout=0.3)
    assert led.claim(req("held")).status is ClaimStatus.ACQUIRED
    inside, release = threading.Event(), threading.Event()

    def hold(conn: sa.Connection) -> None:
        inside.set()
        release.wait(60)

    holder = threading.Thread(target=led._run, args=(hold,))
    holder.start()
    assert inside.wait(10)
    yield led, release
    release.set()
    holder.join(10)
    drop_ledger(led)



@pytest.mark.parametrize("operation", list(OPERATIONS))
def test_an_exhausted_pool_fails_closed(one_connection: tuple[SQLLedger, threading.Event], operation: str) -> None:
    led, release = one_connection
    with pytest.raises(LedgerUnavailableError, match="TimeoutError"):
        OPERATIONS[operation](led)
    release.set()  # the other thread gives its connection back: the same call now works
    for _ in range(100):
        if led._spare is not None:
            break
        threading.Event().wait(0.05)
    _untouched(led)
    OPERATIONS[operation](led)


@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("dialect", ["postgresql", "mariadb"])
def test_a_killed_connection_fails_closed_at_every_step(dialect: str, operation: str, tmp_path: Path) -> None:
    options: dict[str, Any] = {}
    table = unique("kill")
    if dialect == "postgresql":
        options["connect_args"] = {"application_name": table, "connect_timeout": 5}
    led = SQLLedger(_url(dialect, tmp_path), table=table, **options)
    try:
        try:
            led.ping()
        except Exception as exc:
            service_missing(dialect, exc)
        assert led.claim(req("held")).status is ClaimStatus.ACQUIRED
        assert _kill_spare(dialect, led) == 1
        with pytest.raises(LedgerUnavailableError, match="unreachable"):
            OPERATIONS[operation](led)
        _untouched(led)
        OPERATIONS[operation](led)  # on a new connection
    finally:
        drop_ledger(led)


@pytest.mark.parametrize("operation", ROW_WRITERS)
@pytest.mark.parametrize("dialect", ["postgresql", "mariadb"])
def test_a_statement_timed_out_by_the_server_fails_closed(dialect: str, operation: str, tmp_path: Path) -> None:
    """Another session holds the row; the server cancels the ledger's statement after its timeout."""
    url = _url(dialect, tmp_path)
    if dialect == "postgresql":
        timeout = {"connect_args": {"options": "-c statement_timeout=300", "connect_timeout": 5}}
    else:  # 0: the same lock wait timeout (error 1205), at once rather than after a second
        timeout = {"connect_args": {"init_command": "SET SESSION innodb_lock_wait_timeout=0", "connect_timeout": 5}}
    led = _open(url, dialect, **timeout)
    other = sa.create_engine(url)
    try:
        assert led.claim(req("held")).status is ClaimStatus.ACQUIRED
        t = led.table
        with other.connect() as c:
            c.execute(sa.select(t.c.token).where(t.c.intent_key == "held").with_for_update())  # a transaction holds it
            with pytest.raises(LedgerUnavailableError, match="refused"):
                OPERATIONS[operation](led)
            c.rollback()
        _untouched(led)
        OPERATIONS[operation](led)
    finally:
        other.dispose()
        drop_ledger(led)
