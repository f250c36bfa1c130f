"""The SQL ledger's reschedule marks (``mark_hop``): digests only, and purged with the records."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from idemmail_celery.ledger.sql import SQLLedger

from .conftest import drop_ledger, make_ledger

SQL_BACKENDS = ["postgresql", "mariadb", "sqlite"]


@pytest.fixture(params=SQL_BACKENDS)
def sql_ledger(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SQLLedger]:
    led = make_ledger(request.param, tmp_path_factory)
    assert isinstance(led, SQLLedger)
    yield led
    drop_ledger(led)


def _marks(led: SQLLedger) -> list[tuple[str, ...]]:
    return [tuple(str(v) for v in row) for row in led._run(lambda c: c.execute(sa.select(led.hops)).all())]


def test_marks_store_a_digest_never_the_key_or_hop(sql_ledger: SQLLedger) -> None:
    key, hop = "ik:campaign-ann@example.com", "0f2c1e55-task-id:3"
    assert sql_ledger.mark_hop(key, hop, 60) is True
    rows = _marks(sql_ledger)
    assert len(rows) == 1
    text = repr(rows)
    assert "ann@example.com" not in text and "task-id" not in text and "campaign" not in text


def test_purge_expired_removes_expired_marks_and_keeps_live_ones(sql_ledger: SQLLedger) -> None:
    assert sql_ledger.mark_hop("k", "old", 0.2) is True
    assert sql_ledger.mark_hop("k", "live", 60) is True
    time.sleep(0.35)
    sql_ledger.purge_expired()
    assert len(_marks(sql_ledger)) == 1
    assert sql_ledger.mark_hop("k", "live", 60) is False  # the live mark survived the purge
    assert sql_ledger.mark_hop("k", "old", 60) is True
