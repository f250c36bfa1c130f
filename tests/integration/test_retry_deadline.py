"""A provider that refuses connections for a while: retried on a time budget, not on Celery's count.

Real workers on the Redis broker, ``send_email`` against the library's fake HTTP provider and its
SMTP sink, each stopped (connection refused) while intents are queued. Before issue 35 item 8 an
outage of seconds failed intents for good (``retries_exhausted`` after Celery's ``max_retries=3``).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from idemmail_celery import PermanentSendError
from idemmail_celery.ledger import State
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider
from idemmail_celery.testing.smtp_sink import SMTPSink

from ..conftest import require_module, wait_for
from .conftest import results
from .test_monitoring import metrics_worker, scrape

OUTAGE_SECONDS = 20.0
INTENTS = 8
COPIES = 3


def intent(i: int) -> dict[str, Any]:
    return {"to": f"user{i}@example.com", "subject": "Your receipt", "text": f"order {i}", "event_id": f"order-{i}"}


@pytest.mark.parametrize(("provider", "pool"), [
    ("http", ("-P", "prefork", "-c", "2")),
    ("smtp", ("-P", "gevent", "-c", "50")),  # the pools a sender runs, at their concurrency
    ("http", ("-P", "threads", "-c", "20")),
], ids=["http-prefork", "smtp-gevent", "http-threads"])
def test_a_provider_refusing_connections_for_20_s_costs_no_email(
    provider: str, pool: tuple[str, ...], worker_env: dict[str, str], request: pytest.FixtureRequest,
    start_worker: Callable[..., Any]
) -> None:
    if "gevent" in pool:
        require_module("gevent")
    # The library's retry budget (its default deadline); only the backoff's cap is lowered, to 4 s from 300 s,
    # so the intents are back within seconds of the provider: Celery's 3 retries still end within 10 s of 20.
    worker_env.update(IDEMMAIL_TEST_RETRY_BACKOFF="2", IDEMMAIL_TEST_RETRY_BACKOFF_MAX="4")
    http = FakeProvider() if provider == "http" else None
    smtp = SMTPSink() if provider == "smtp" else None
    if http is not None:
        http.start()
        worker_env.update(IDEMMAIL_TEST_PROVIDER=http.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY)
    else:
        assert smtp is not None
        smtp.start()
        worker_env.update(IDEMMAIL_TEST_PROVIDER=smtp.url, IDEMMAIL_TEST_PROVIDER_TIMEOUT="5")
    server: Any = http or smtp
    try:
        app_module = request.getfixturevalue("app_module")
        task = app_module.app.tasks[TASK_NAME]
        keys = [task.intent_key(**intent(i)) for i in range(INTENTS)]
        server.stop()  # connection refused from now on
        worker = start_worker(*pool)
        sent = [task.delay(**intent(i)) for _ in range(COPIES) for i in range(INTENTS)]

        def all_refused() -> bool:  # each intent tried and released: the worker met the outage
            records = [task.ledger.get(k) for k in keys]
            return all(r is not None and r.state is State.RELEASED for r in records)

        wait_for(all_refused, timeout=60)
        time.sleep(OUTAGE_SECONDS)  # the outage, counted from the refusals (a worker may be slow to start)
        server.start()
        out = results(sent, timeout=120)

        assert [o for o in out if not isinstance(o, dict)] == []  # none failed, none parked
        assert Counter(o["status"] for o in out) == {"sent": INTENTS, "duplicate": INTENTS * (COPIES - 1)}
        if http is not None:
            assert {k: http.delivery_count(k) for k in keys} == dict.fromkeys(keys, 1)
        else:
            assert smtp is not None
            by_key = Counter((m.message_id or "").strip("<>").split("@", 1)[0] for m in smtp.messages())
            assert by_key == dict.fromkeys(keys, 1)
        records = [task.ledger.get(k) for k in keys]
        assert all(r.state is State.SENT for r in records)
        # A copy refused a fifth time was retried again, past Celery's max_retries=3: the count no longer decides.
        refused = re.findall(r"status=retry .* attempts=(\d+) reason=connect", worker.log().decode())
        assert max(map(int, refused)) >= 5, Counter(refused)
    finally:
        server.stop()


def test_a_short_retry_deadline_ends_the_intent_failed_naming_it_logged_and_counted(
    worker_env: dict[str, str], request: pytest.FixtureRequest, start_worker: Callable[..., Any], tmp_path: Path
) -> None:
    deadline = 4.0
    with FakeProvider() as fake:
        worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY,
                          IDEMMAIL_TEST_RETRY_DEADLINE=str(deadline))
        app_module = request.getfixturevalue("app_module")
        task = app_module.app.tasks[TASK_NAME]
        worker, port, _ = metrics_worker(start_worker, tmp_path, "-c", "2")
        fake.stop()  # refused for good
        enqueued = time.time()
        out = results([task.delay(**intent(1))], timeout=60)[0]

        assert isinstance(out, PermanentSendError) and out.reason == "retry_deadline", out
        assert "retry deadline" in str(out)
        record = task.ledger.get(task.intent_key(**intent(1)))
        assert record.state is State.FAILED and record.error["reason"] == "retry_deadline"
        assert record.attempts > 4  # retried past Celery's count, until the deadline
        # Measured from the first enqueue: neither before the deadline nor long after it.
        assert deadline <= record.updated_at - enqueued < deadline + 10
        assert "order 1" in (record.payload or "")  # kept, ready to re-enqueue
        failed = ("idemmail_failed_total", (("reason", "retry_deadline"), ("task", TASK_NAME)))
        wait_for(lambda: scrape(port).get(failed) == 1.0, timeout=15, interval=0.2)
        log = worker.log().decode()
        ours = [line for line in log.splitlines() if "status=failed" in line and "reason=retry_deadline" in line]
        assert len(ours) == 1 and "ERROR" in ours[0], ours
