"""The library under the pools email senders run: ``-P threads`` and ``-P gevent``, real workers.

One worker process runs many tasks at once there, so what prefork keeps apart by process is
shared: the ledger's connections (one per call under way), the lease renewal thread (a greenlet
under gevent), the one ``task-idemmail`` event dispatcher, and the metrics registry (no
multiprocess directory needed). Each test runs once per pool, on a Redis broker whose transport
pool is raised to the concurrency (see docs/deployment.md, "Pools"); the claim race and the lease
renewal run once more per ledger, Redis and PostgreSQL (psycopg, which waits through gevent's hub
once Celery has patched the standard library).

gevent is a test dependency: a missing one fails the run (see ``require_module`` in conftest.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from idemmail_celery import SendNeedsReview
from idemmail_celery.ledger import State, from_url

from ..conftest import POSTGRES_URL, require_module, service_missing, wait_for
from .conftest import EventTap, WorkerProcess, results
from .test_monitoring import free_port, scrape

CONCURRENCY = {"threads": "20", "gevent": "100"}


@pytest.fixture(params=sorted(CONCURRENCY))
def pool(request: pytest.FixtureRequest) -> str:
    if request.param == "gevent":
        require_module("gevent")
    return str(request.param)


@pytest.fixture
def ledger_url(request: pytest.FixtureRequest, ns: str) -> Iterator[str | None]:
    """The worker's ledger: the app's default (Redis), or PostgreSQL in a table of this test's own.

    Parametrise it indirectly with ``"redis"`` or ``"postgresql"``.
    """
    backend = getattr(request, "param", "redis")
    if backend == "redis":
        yield None
        return
    assert backend == "postgresql", backend
    ledger = from_url(POSTGRES_URL, table=f"led_{ns}")  # the table the worker app names after the namespace
    try:
        ledger.ping()
    except Exception as exc:
        ledger.close()
        service_missing("postgresql", exc)
    try:
        yield POSTGRES_URL
        # The test's records went there (the table is made on first use), not to the default Redis.
        assert sa.inspect(ledger.engine).has_table(f"led_{ns}")
    finally:
        ledger.drop_table()  # after the workers stopped: this fixture was set up before them
        ledger.close()


@pytest.fixture
def worker_env(worker_env: dict[str, str], ledger_url: str | None) -> dict[str, str]:
    """The caller (``app_module``) and the workers use the same ledger."""
    return {**worker_env, "IDEMMAIL_TEST_LEDGER": ledger_url} if ledger_url else worker_env


BOTH_LEDGERS = pytest.mark.parametrize("ledger_url", ["redis", "postgresql"], indirect=True)


def pool_worker(start_worker: Callable[..., WorkerProcess], pool: str, *args: str, **env: str) -> WorkerProcess:
    return start_worker("-P", pool, "-c", CONCURRENCY[pool], *args,
                        env={"IDEMMAIL_TEST_MAX_CONNECTIONS": str(2 * int(CONCURRENCY[pool])), **env})


@BOTH_LEDGERS
def test_copies_enqueued_at_once_deliver_each_intent_once(
    pool: str, app_module: Any, sink: Any, start_worker: Callable[..., WorkerProcess]
) -> None:
    """40 intents, 3 copies each, all in the queue before the worker starts: claims race inside one process
    (120 messages: more than the gevent pool's 100 run at once)."""
    send = app_module.send
    n = 40
    ars = [send.delay(f"user{i}@example.com", i) for i in range(n) for _ in range(3)]
    pool_worker(start_worker, pool)
    out = results(ars, timeout=120)
    assert Counter(o["status"] for o in out) == {"sent": n, "duplicate": 2 * n}
    deliveries = sink.deliveries()
    assert len(deliveries) == n
    assert len({d.split("|")[0] for d in deliveries}) == n
    keys = {send.intent_key(f"user{i}@example.com", i) for i in range(n)}
    assert {send.ledger.get(k).state for k in keys} == {State.SENT}  # type: ignore[union-attr]


@BOTH_LEDGERS
def test_a_body_outliving_its_lease_keeps_its_claim(
    pool: str, app_module: Any, sink: Any, start_worker: Callable[..., WorkerProcess]
) -> None:
    """Lease 1.5 s, body 3.5 s: the renewal thread (a greenlet under gevent) keeps the claim, so the copy
    that arrives meanwhile waits and replays instead of reclaiming (which, with no key downstream,
    would park the intent for review)."""
    pool_worker(start_worker, pool, IDEMMAIL_TEST_LEASE="1.5")
    sink.control("hold", "3.5")
    first = app_module.send.delay("lee@example.com", 11)
    wait_for(lambda: sink.pids())
    second = app_module.send.delay("lee@example.com", 11)
    out = results([first, second], timeout=90)
    assert [o["status"] for o in out] == ["sent", "duplicate"]
    assert len(sink.deliveries()) == 1
    record = app_module.send.ledger.get(app_module.send.intent_key("lee@example.com", 11))
    assert record is not None and record.state is State.SENT and record.reclaims == 0


def test_outcome_events_and_metrics_from_concurrent_tasks(
    pool: str, app_module: Any, sink: Any, start_worker: Callable[..., WorkerProcess], event_tap: EventTap
) -> None:
    """Ten sends that end in review at once: ten task-idemmail events through the one shared dispatcher,
    and the outcome counters served from the worker's own registry."""
    port = free_port()
    pool_worker(start_worker, pool, "-E", IDEMMAIL_TEST_METRICS_PORT=str(port))
    send = app_module.send
    for _ in range(10):
        sink.push_failure("ambiguous")
    reviews = results([send.delay(f"rev{i}@example.com", 100 + i) for i in range(10)], timeout=90)
    assert all(isinstance(o, SendNeedsReview) for o in reviews), reviews
    sent = results([send.delay(f"ok{i}@example.com", 200 + i) for i in range(5) for _ in range(2)], timeout=90)
    assert Counter(o["status"] for o in sent) == {"sent": 5, "duplicate": 5}

    wait_for(lambda: len([e for e in event_tap.of_type("task-idemmail") if e["status"] == "review"]) >= 10)
    events = [e for e in event_tap.of_type("task-idemmail") if e["status"] == "review"]
    assert len(events) == 10
    assert {e["key"] for e in events} == {send.intent_key(f"rev{i}@example.com", 100 + i) for i in range(10)}

    def outcome(status: str) -> float:
        metrics = scrape(port)
        return metrics.get(("idemmail_outcomes_total", (("outcome", status), ("task", send.name))), 0.0)

    wait_for(lambda: outcome("duplicate") == 5)
    assert (outcome("review"), outcome("sent"), outcome("duplicate")) == (10, 5, 5)
