"""Raw ``idempotency_key`` headers are checked, namespaced and hashed like ``idempotency_key=`` (issue 14).

Real publishes to the Redis broker (the raw message read back from its queue); the worker side runs
the task in process (``Task.apply``) against a real SQLite ledger.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from idemmail_celery import IdempotentTask
from idemmail_celery._common import KEY_HEADER
from idemmail_celery.errors import IdempotencyKeyError, PermanentSendError
from idemmail_celery.keys import is_derived_key
from idemmail_celery.ledger import ClaimRequest

from .conftest import REDIS_URL, service_missing, unique


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    a = Celery(unique("rawkeys"), broker=REDIS_URL, set_as_current=False)
    a.conf.update(task_default_queue=unique("q"), idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}",
                  idemmail_key_secret="s")
    r = redis.Redis.from_url(REDIS_URL)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    yield a
    r.delete(a.conf.task_default_queue)
    a.close()


def published(app: Celery) -> list[dict[str, Any]]:
    raw = redis.Redis.from_url(REDIS_URL).lrange(app.conf.task_default_queue, 0, -1)
    return [json.loads(m)["headers"] for m in reversed(raw)]


def charge_task(app: Celery) -> Any:
    @app.task(base=IdempotentTask, shared=False, name=unique("charge"), bind=True)
    def charge(self: Any, order_id: int) -> str:
        if order_id < 0:
            raise ValueError("card of ann.private@example.com refused")
        return str(self.request.idempotency_key)

    return charge


def test_a_raw_header_key_is_hashed_like_an_explicit_one(app: Celery) -> None:
    charge = charge_task(app)
    charge.apply_async((1,), headers={KEY_HEADER: "ann@example.com:order-1"})
    charge.apply_async((1,), idempotency_key="ann@example.com:order-1")
    raw, explicit = published(app)
    assert raw[KEY_HEADER] == explicit[KEY_HEADER] == charge.key_builder.explicit_key("ann@example.com:order-1")
    assert "ann@" not in json.dumps(raw)


@pytest.mark.parametrize("bad", ["order\n1", "x" * 300, 42, ""])
def test_a_bad_raw_header_key_is_refused_before_anything_is_published(app: Celery, bad: Any) -> None:
    charge = charge_task(app)
    with pytest.raises(IdempotencyKeyError):
        charge.apply_async((1,), headers={KEY_HEADER: bad})
    assert published(app) == []


def test_a_derived_key_header_travels_unchanged(app: Celery) -> None:
    """A retry, or a copy re-enqueued by `ledger resolve --release`, keeps its key."""
    charge = charge_task(app)
    derived = charge.intent_key(1)
    charge.apply_async((1,), headers={KEY_HEADER: derived})
    assert published(app)[0][KEY_HEADER] == derived


def test_the_worker_hashes_a_raw_header_and_keeps_a_record_made_under_it_before(app: Celery) -> None:
    charge = charge_task(app)
    hashed = charge.apply((1,), headers={KEY_HEADER: "order-1"}).get()["key"]
    assert hashed == charge.key_builder.explicit_key("order-1") and is_derived_key(hashed)
    # A record written by an older release under the raw key itself is found, not sent again.
    led = charge.ledger
    claim = led.claim(ClaimRequest(key="order-2", task_name=charge.name, payload='{"args":[2],"kwargs":{}}',
                                   fingerprint=""))
    led.complete("order-2", claim.token, {"value": "first", "message_id": None})
    again = charge.apply((2,), headers={KEY_HEADER: "order-2"}).get()
    assert again["status"] == "duplicate" and again["key"] == "order-2"


def test_an_exception_text_reaches_the_ledger_without_addresses(app: Celery) -> None:
    charge = charge_task(app)
    outcome = charge.apply((-1,))
    record = charge.ledger.get(charge.intent_key(-1))
    assert record is not None and record.error is not None
    assert "ann.private@example.com" not in json.dumps(record.error) and "<address>" in record.error["message"]
    assert isinstance(outcome.result, (PermanentSendError, Exception))
