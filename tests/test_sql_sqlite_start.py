"""The embedded default never calls a healthy SQLite file "unreachable" when a prefork worker starts.

The cause (issue 15): switching a new file to WAL needs its exclusive lock, and SQLite refuses
at once ("database is locked"), without waiting out the busy timeout, while another connection
holds a write lock on it. Pool children opening a new file together met that at their first
claim, which the ledger reported as unreachable. The ledger now retries the switch within the
busy window, switches only a file not yet in WAL, and a worker's main process sets the file up
(:meth:`SQLLedger.prepare`) before the pool forks.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State, from_url
from idemmail_celery.ledger.sql import SQLLedger

from .conftest import REDIS_URL, service_missing, unique, wait_for


def req(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="t", payload="{}", fingerprint="f" * 64, lease_seconds=60)


def _journal_mode(path: Path) -> str:
    with sqlite3.connect(path) as c:
        return str(c.execute("PRAGMA journal_mode").fetchone()[0])


def test_first_claim_waits_out_a_writer_on_a_new_file_instead_of_failing(tmp_path: Path) -> None:
    """Deterministic form of the race: another connection holds the new file's write lock."""
    path = tmp_path / "ledger.sqlite3"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN IMMEDIATE")  # what a sibling switching the file to WAL, or creating the table, holds
    done = threading.Timer(0.5, lambda: writer.execute("COMMIT"))
    done.start()
    led = SQLLedger(f"sqlite:///{path}")
    try:
        assert led.claim(req("first")).status is ClaimStatus.ACQUIRED
    finally:
        done.join()
        writer.close()
        led.close()
    assert _journal_mode(path) == "wal"


def _first_claims(urls: list[str], barrier: Any, out: Any, n: int) -> None:
    errors = []
    for url in urls:
        led = from_url(url)
        assert isinstance(led, SQLLedger)
        led.engine  # noqa: B018 - built now, so that after the barrier only the connection is timed
        barrier.wait()  # every process opens this new file at the same instant
        try:
            status = led.claim(req(f"k{n}")).status
            if status is not ClaimStatus.ACQUIRED:
                errors.append(f"{url}: {status.value}")
        except Exception as exc:  # reported to the test
            errors.append(f"{url}: {type(exc).__name__}: {exc}")
        led.close()
    out.put(errors)


@pytest.mark.worker
def test_processes_racing_first_claims_on_new_files_never_fail(tmp_path: Path) -> None:
    """Four forked processes (a prefork pool) make their first claim together, on 200 new files in turn.

    On the old code a few files in a hundred saw "database is locked" at connect (how many
    depends on the machine's load); the deterministic form is the test above.
    """
    urls = [f"sqlite:///{tmp_path / f'l{i}.sqlite3'}" for i in range(200)]
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_first_claims, args=(urls, barrier, out, n)) for n in range(4)]
    for p in procs:
        p.start()
    errors = [e for _ in procs for e in out.get(timeout=300)]
    for p in procs:
        p.join(30)
    assert errors == []
    for url in urls[:: len(urls) // 6]:
        led = from_url(url)
        assert sorted(r.key for r in led.iter_records(State.CLAIMED)) == ["k0", "k1", "k2", "k3"]
        led.close()


def test_prepare_sets_up_the_file_and_carries_no_connection_across_fork(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    led = SQLLedger(f"sqlite:///{path}")
    led.prepare()
    assert _journal_mode(path) == "wal"
    assert led._spare is None and led._engine is None  # nothing open for a pool child to inherit
    with sqlite3.connect(path) as c:
        tables = {row[0] for row in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {led.table.name, led.hops.name} <= tables
    assert led.claim(req("after")).status is ClaimStatus.ACQUIRED
    led.close()


@pytest.mark.worker
def test_a_prefork_worker_on_a_new_file_serves_its_first_sends(tmp_path: Path) -> None:
    """A real ``-P prefork -c 4`` worker on a SQLite ledger that does not exist yet: 40 sends at once."""
    import redis

    from .integration.conftest import ROOT, Sink, WorkerProcess

    ns = unique("sq").replace("_", "")
    sink = Sink(ns)
    try:
        sink.r.ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    ledger_url = f"sqlite:///{tmp_path / 'new' / 'ledger.sqlite3'}"
    (tmp_path / "new").mkdir()
    env = {**os.environ, "IDEMMAIL_TEST_NS": ns, "PYTHONPATH": str(ROOT),
           "IDEMMAIL_TEST_LEDGER": ledger_url, "IDEMMAIL_TEST_REDIS": REDIS_URL}
    worker = WorkerProcess(ns, env, tmp_path, ["-P", "prefork", "-c", "4"])
    from celery import Celery

    app = Celery("sqlite_start", broker=REDIS_URL)
    try:
        # Queued before the worker starts: every pool child's first claim comes at once.
        for i in range(40):
            app.send_task("tests.integration.workerapp.send", args=(f"u{i}@example.com", i),
                          queue=f"q.{ns}", task_id=str(uuid.uuid4()))
        worker.start()
        wait_for(lambda: len(sink.deliveries()) >= 40, timeout=120)
        led = from_url(ledger_url, table=f"led_{ns}")
        wait_for(lambda: led.stats()["sent"] == 40, timeout=60)
        log = worker.log()
        assert b"unreachable" not in log and b"database is locked" not in log, log[-3000:]
        assert len(sink.deliveries()) == 40 and len(set(sink.deliveries())) == 40
        led.close()
    finally:
        worker.stop()
        sink.cleanup()
        app.close()


@pytest.fixture(autouse=True)
def _no_leftover_children() -> Any:
    yield
    for child in multiprocessing.active_children():
        child.join(5)
