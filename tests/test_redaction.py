"""Arguments never show in a published message's argsrepr/kwargsrepr, whatever path published it.

Real publishes to the Redis broker; the raw message is read back from its queue.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

import idemmail_celery  # noqa: F401  (registers send_email and send_campaign on every app)
from idemmail_celery import IdempotentTask
from idemmail_celery.bulk import CAMPAIGN_TASK
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.outbox import create_outbox_table, enqueue, relay
from idemmail_celery.task import KEY_HEADER

from .conftest import REDIS_URL, service_missing, unique

ADDRESS = "ann@example.com"


@pytest.fixture
def app() -> Iterator[Celery]:
    a = Celery(unique("redact"), broker=REDIS_URL, set_as_current=False)
    a.conf.update(task_default_queue=unique("q"), idemmail_ledger_url="sqlite://", idemmail_key_secret="s",
                  idemmail_provider_url="console://", idemmail_default_from="Shop <shop@example.com>")
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


def shown(headers: dict[str, Any]) -> str:
    return f"{headers['argsrepr']} {headers['kwargsrepr']}"


def test_send_task_by_name_is_redacted_like_apply_async(app: Celery) -> None:
    @app.task(base=IdempotentTask, shared=False, name=unique("charge"), idempotency_key=("to", "order_id"))
    def charge(to: str, order_id: int) -> None: ...

    charge.delay(ADDRESS, 1)
    app.send_task(charge.name, args=[ADDRESS, 1])
    app.send_task(charge.name, kwargs={"to": ADDRESS, "order_id": 1})
    sent = published(app)
    assert len(sent) == 3
    for headers in sent:
        assert headers["argsrepr"] == "<redacted>" and ADDRESS not in shown(headers)
    assert sent[0]["kwargsrepr"] == f"<redacted: idempotency key {sent[0][KEY_HEADER]}>"


def test_redaction_is_the_default_and_a_task_may_turn_it_off(app: Celery) -> None:
    @app.task(base=IdempotentTask, shared=False, name=unique("shown"), idempotency_redact_args=False)
    def shown_task(order_id: int, note: str) -> None: ...

    @app.task(shared=False, name=unique("plain"))
    def plain(to: str) -> None: ...

    shown_task.delay(7, "not personal")
    app.send_task(shown_task.name, args=[7, "not personal"])
    plain.delay(ADDRESS)  # not an idempotent task: Celery's own behaviour
    sent = published(app)
    assert "not personal" in shown(sent[0]) and "not personal" in shown(sent[1])
    assert ADDRESS in shown(sent[2])


def test_a_task_this_process_does_not_know_is_redacted_when_it_carries_an_intent_key(app: Celery) -> None:
    app.send_task("elsewhere.charge", args=[ADDRESS], headers={KEY_HEADER: "k-1"})
    app.send_task("elsewhere.plain", args=[ADDRESS])
    sent = published(app)
    assert shown(sent[0]) == "<redacted> <redacted: idempotency key k-1>"
    assert ADDRESS in shown(sent[1])


def test_the_outbox_relay_fallback_for_an_unknown_task_is_redacted(app: Celery) -> None:
    engine = sa.create_engine("sqlite://")
    table = create_outbox_table(engine, unique("outbox"))

    @app.task(base=IdempotentTask, shared=False, name=unique("ob"), idempotency_key=("to",))
    def charge(to: str, amount: int) -> None: ...

    with engine.begin() as conn:
        enqueue(conn, charge, (ADDRESS, 5), table=table)
    relay_app = Celery(unique("relay"), broker=REDIS_URL, set_as_current=False)
    relay_app.conf.task_default_queue = app.conf.task_default_queue
    assert charge.name not in relay_app.tasks
    assert relay(engine, relay_app, table=table) == 1
    [headers] = published(app)
    assert headers["task"] == charge.name and ADDRESS not in shown(headers)


def test_send_email_and_campaign_by_name_show_no_recipient_subject_or_body(app: Celery) -> None:
    app.send_task(TASK_NAME, kwargs={"to": ADDRESS, "subject": "Your receipt", "html": "<p>Thanks</p>",
                                     "event_id": "o-1"})
    app.tasks[CAMPAIGN_TASK].delay(campaign_id="nov", recipients=[ADDRESS, "bob@example.com"],
                                   subject="Your receipt", html="<p>Thanks</p>")
    sent = published(app)
    assert len(sent) == 2
    for headers in sent:
        text = shown(headers)
        assert ADDRESS not in text and "Your receipt" not in text and "Thanks" not in text
