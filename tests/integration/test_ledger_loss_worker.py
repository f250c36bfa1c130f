"""Ledger flush under a real worker: nothing resends until a person acknowledges the loss."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from idemmail_celery.ledger.redis import DEFAULT_BUCKETS, DEFAULT_SHELVES, Names
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

from ..conftest import REDIS_URL, wait_for
from .conftest import ROOT, Sink


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider(dedupe=False) as f:  # a provider that does not de-duplicate: every POST delivers
        yield f


def ledger_keys(sink: Sink) -> list[str]:
    return list(sink.r.scan_iter(f"led.{sink.ns}:*", count=1000))


def lost_flagged(sink: Sink) -> bool:
    markers = Names(f"led.{sink.ns}", DEFAULT_BUCKETS, DEFAULT_SHELVES)  # the worker's ledger: the default buckets
    return any(sink.r.hget(markers.marker(b), "lost") for b in range(DEFAULT_BUCKETS))


def test_flushed_ledger_sends_nothing_until_the_loss_is_acknowledged(
    fake: FakeProvider, sink: Sink, worker_env: dict[str, str], request: pytest.FixtureRequest, start_worker: Any
) -> None:
    worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY)
    app_module = request.getfixturevalue("app_module")
    # One task per child: the copy after the flush runs in a child that never used the ledger, and must
    # still know the epoch (read by the worker's main process at start and inherited), not start afresh.
    worker = start_worker("-P", "prefork", "-c", "2", "--max-tasks-per-child", "1")
    task = app_module.app.tasks[TASK_NAME]
    kw = {"to": "ann@example.com", "subject": "Receipt", "text": "thanks", "event_id": "order-77"}
    first = task.delay(**kw).get(timeout=60)
    assert first["status"] == "sent" and fake.delivery_count() == 1
    key = first["key"]

    names = ledger_keys(sink)
    assert names, "the worker's ledger keys are under the test's prefix"
    sink.r.delete(*names)  # the ledger is lost: Redis flushed, or restarted without AOF

    again = task.delay(**kw)  # the same intent, redelivered
    wait_for(lambda: lost_flagged(sink), timeout=30)  # a worker met the loss and stopped everyone
    time.sleep(2.0)  # rescheduled attempts keep coming (backoff 0.2-1 s) and keep being refused
    assert fake.attempt_count(key) == 1 and fake.delivery_count() == 1
    assert not again.ready()
    assert not any(":r:" in n for n in ledger_keys(sink)), "a lost store got a record written"
    assert b"LOST" in worker.log() and b"ack-loss" in worker.log()

    done = subprocess.run(
        [sys.executable, "-m", "idemmail_celery", "--ledger-url", REDIS_URL, "--prefix", f"led.{sink.ns}",
         "ledger", "ack-loss", "--note", "test: flushed on purpose"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    # Acknowledged: the old intent is forgotten, so its redelivered copy sends again. A person decided that.
    out = again.get(timeout=60)
    assert out["status"] == "sent" and out["key"] == key
    assert fake.delivery_count() == 2


def test_after_the_acknowledgement_a_keyless_copy_from_before_it_is_parked_not_resent(
    sink: Sink, request: pytest.FixtureRequest, start_worker: Any
) -> None:
    """Without a key downstream (think SMTP), a copy enqueued before the acknowledgement may be a
    copy of an intent sent and forgotten: it goes to review. One enqueued after it is a new send."""
    from idemmail_celery import SendNeedsReview
    from idemmail_celery.ledger import State, from_url

    app_module = request.getfixturevalue("app_module")
    start_worker("-P", "prefork", "-c", "2")
    first = app_module.send.delay("kim@example.com", 88).get(timeout=60)
    assert first["status"] == "sent" and len(sink.deliveries()) == 1
    sink.r.delete(*ledger_keys(sink))  # the ledger is lost

    before = app_module.send.delay("kim@example.com", 88)  # a copy of the delivered intent
    wait_for(lambda: lost_flagged(sink), timeout=30)
    done = subprocess.run(
        [sys.executable, "-m", "idemmail_celery", "--ledger-url", REDIS_URL, "--prefix", f"led.{sink.ns}",
         "ledger", "ack-loss", "--note", "test: flushed on purpose"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr

    with pytest.raises(SendNeedsReview) as parked:
        before.get(timeout=60)
    assert parked.value.reason == "ledger_lost"
    assert len(sink.deliveries()) == 1  # not resent on a guess
    ledger = from_url(REDIS_URL, prefix=f"led.{sink.ns}")
    record = ledger.get(first["key"])
    assert record is not None and record.state is State.REVIEW and record.payload  # ready to release

    new = app_module.send.delay("lee@example.com", 89).get(timeout=60)  # enqueued after: an ordinary send
    assert new["status"] == "sent" and len(sink.deliveries()) == 2
