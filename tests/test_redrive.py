"""The sweep that re-drives stranded claims (``idemmail_celery.redrive``), on a real ledger and broker queue."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from idemmail_celery import IdempotentTask, TransientSendError
from idemmail_celery.chain import KEY_HEADER
from idemmail_celery.handler import Action, Delivery, Handler
from idemmail_celery.keys import Payload
from idemmail_celery.ledger import ClaimRequest, State
from idemmail_celery.redrive import (
    LOCK_KEY,
    MIN_SWEEP_AFTER,
    SWEEP_TASK,
    bound_restore_lock,
    redelivered_after,
    restore_unacked,
    stranded_after,
    sweep_stranded,
)

from .conftest import RABBITMQ_URL, REDIS_URL, drop_ledger, unique, wait_for
from .test_handler import Mailbox, Refusing


def test_one_sweeper_at_a_time_republishes_a_stranded_claim_once_under_its_own_key(
    redis_broker_app: Celery,
) -> None:
    app = redis_broker_app

    @app.task(base=IdempotentTask, bind=True, shared=False, idempotency_key=("to",))
    def notify(self: Any, to: str) -> None: ...

    # A task of the same app whose ledger does not answer: the sweep skips it and goes on with the others.
    @app.task(base=IdempotentTask, shared=False, name=f"{app.main}.elsewhere",
              idempotency_ledger_url="redis://127.0.0.1:1/0")
    def elsewhere(to: str) -> None: ...

    ledger = notify.ledger
    key = notify.intent_key("ann@example.com")
    first = Payload(["ann@example.com"], {})
    ledger.claim(ClaimRequest(key=key, task_name=notify.name, payload=first.to_json(),
                              fingerprint=notify.key_builder.fingerprint(first), owner="gone:1:dead",
                              lease_seconds=0.1))
    later = time.time() + 120
    other = ledger.claim(ClaimRequest(key=LOCK_KEY, task_name=SWEEP_TASK, payload=Payload([], {}).to_json(),
                                      fingerprint="", owner="another-sweeper", lease_seconds=60.0))
    assert sweep_stranded(app, after_seconds=60, now=later) == []  # another sweeper has this ledger
    ledger.release(LOCK_KEY, other.token)
    assert sweep_stranded(app, after_seconds=60, now=later) == [key]
    assert ledger.get(LOCK_KEY) is None  # the sweep's lease is withdrawn: no record for operators to count
    assert sweep_stranded(app, after_seconds=60, now=later) == []  # not twice in one period
    r = redis.Redis.from_url(REDIS_URL)
    try:
        queued = [json.loads(m) for m in r.lrange(app.conf.task_default_queue, 0, -1)]
    finally:
        r.close()
    assert len(queued) == 1 and queued[0]["headers"][KEY_HEADER] == key  # claimed under its own key, as it is
    body = json.loads(base64.b64decode(queued[0]["body"]))  # kombu's Redis transport: base64 bodies
    assert body[0] == ["ann@example.com"]  # from the stored first payload


@pytest.mark.parametrize(("broker", "options", "conf", "task_options", "expected"), [
    # Redis, a 10 s visibility timeout, kombu's restore delay (10 x 10 s): the retry backoff maximum (300 s) leads.
    ("redis://h/0", {"visibility_timeout": 10}, {}, {}, 600.0),
    ("redis://h/0", {}, {}, {}, 2 * (3600 + 100)),  # the transport's default hour, then its restore delay
    ("redis://h/0", {"visibility_timeout": 600, "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
     {}, {}, 2 * 601),
    ("amqp://h//", {}, {}, {}, 600.0),  # no visibility timeout: the backoffs
    ("amqp://h//", {}, {}, {"retry_backoff": True, "retry_backoff_max": 900}, 1800.0),  # Celery's own maximum
    ("amqp://h//", {}, {"idemmail_retry_backoff_max": 5, "idemmail_inflight_backoff_max": 5}, {}, MIN_SWEEP_AFTER),
    ("redis://h/0", {"visibility_timeout": 10}, {"idemmail_sweep_after_seconds": 42}, {}, 42.0),  # as set
])
def test_a_claim_is_stranded_after_twice_the_longest_a_live_chain_leaves_it_alone(
    tmp_path: Any, broker: str, options: dict[str, Any], conf: dict[str, Any], task_options: dict[str, Any],
    expected: float
) -> None:
    app = Celery("stranded", broker=broker, set_as_current=False)
    app.conf.update(broker_transport_options=options, idemmail_ledger_url=f"sqlite:///{tmp_path / 'l.sqlite3'}",
                    **conf)

    @app.task(base=IdempotentTask, shared=False, **task_options)
    def notify(to: str) -> None: ...

    assert stranded_after(app, [notify]) == expected


@pytest.fixture
def rabbit_app(tmp_path: Any) -> Iterator[tuple[Celery, Any, list[str]]]:
    """An app on RabbitMQ (no visibility timeout: the sweep's age is the tasks' longest waits) with a Redis ledger
    of its own, one task, and the keys the sweep republishes it under (caught, not published)."""
    app = Celery(unique("rabbit"), broker=RABBITMQ_URL, set_as_current=False)
    app.conf.update(idemmail_ledger_url=REDIS_URL, idemmail_ledger_options={"prefix": unique("led")},
                    idemmail_key_secret="s")

    @app.task(base=IdempotentTask, shared=False, idempotency_key=("to",))
    def notify(to: str) -> None: ...

    republished: list[str] = []
    notify.apply_async = lambda args=None, kwargs=None, **options: republished.append(options["headers"][KEY_HEADER])
    yield app, notify, republished
    drop_ledger(notify.ledger.backend)


def test_a_claim_waiting_out_a_providers_retry_after_is_not_re_driven_meanwhile(
    rabbit_app: tuple[Celery, Any, list[str]]
) -> None:
    """A provider answered 429 with ``Retry-After: 3600`` and the claim's release did not land (the ledger blinked):
    the claim stays ``claimed``, renewed by nobody, until the retry comes back for it. The retry waited the whole
    hour, and the sweep took the claim for stranded after 600 s: its republished copy reclaimed it under the
    waiting retry (a reclaim counted, a keyless send parked for review). The wait is now honoured up to the
    retry backoff's maximum, which the sweep's age is twice."""
    app, notify, republished = rabbit_app
    ledger = Refusing(notify.ledger)
    ledger.down.add(State.RELEASED.value)
    box = Mailbox()
    box.fail_with = TransientSendError("429 too many requests", reason="rate_limited", retry_after=3600.0)
    handler = Handler(ledger, notify.key_builder, notify.policy, box)
    key = notify.intent_key("ann@example.com")
    started = time.time()
    step = handler.handle(Delivery(key=key, task_name=notify.name, payload=Payload(["ann@example.com"], {}),
                                   attempt_id="t-1", retry_from=started))
    assert step.action is Action.RETRY and box.sent == []
    record = notify.ledger.get(key)
    assert record is not None and record.state is State.CLAIMED  # the release did not land
    age = stranded_after(app, [notify])
    assert step.countdown * 2 <= age, (step.countdown, age)
    # Just before the retry comes back for its claim, the sweep leaves it alone.
    assert sweep_stranded(app, now=started + step.countdown - 1) == [] and republished == []
    # A claim nobody comes back for is still re-driven, once its age has passed.
    assert sweep_stranded(app, now=(record.lease_expires_at or 0) + age + 1) == [key] and republished == [key]


def test_a_claim_renewed_after_the_sweep_listed_it_is_not_re_driven(
    rabbit_app: tuple[Celery, Any, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep lists claims page by page and republishes as it goes: a holder alive but slow to renew (its
    renewal came through after the listing) must keep its claim. Each claim is read again before it is re-driven,
    and one whose lease is live is never re-driven, whatever the age."""
    app, notify, republished = rabbit_app
    ledger = notify.ledger
    key = notify.intent_key("bob@example.com")
    first = Payload(["bob@example.com"], {})
    claim = ledger.claim(ClaimRequest(key=key, task_name=notify.name, payload=first.to_json(),
                                      fingerprint=notify.key_builder.fingerprint(first), owner="slow:1:alive",
                                      lease_seconds=0.1))
    time.sleep(0.2)
    listed = [r for r in ledger.iter_records(State.CLAIMED) if r.key == key]
    assert ledger.renew(key, claim.token, 600.0)  # the holder's renewal lands after the listing
    monkeypatch.setattr(ledger, "iter_records", lambda state=None: iter(listed))
    assert sweep_stranded(app, after_seconds=60, now=time.time() + 120) == [] and republished == []
    assert sweep_stranded(app, after_seconds=1e-9) == []  # live: not re-driven at any age
    record = ledger.get(key)
    assert record is not None and record.token == claim.token and record.reclaims == 0


@pytest.mark.parametrize(("broker", "options", "event_loop", "expected"), [
    ("redis://h/0", {}, True, 3600 + 10 * 10),  # kombu's defaults: an hour, then a scan every 10 x 10 s
    ("redis://h/0", {}, False, 3600 + 10),  # a green pool: the library's timer, every unacked_restore_interval
    ("redis://h/0", {"visibility_timeout": 10, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}, True, 11),
    ("sqs://", {"visibility_timeout": 60}, True, 60),  # SQS hands it out again itself
    ("amqp://h//", {}, True, 0),  # requeued when the dead worker's connection drops
])
def test_a_dead_workers_messages_come_back_after_the_visibility_timeout_and_one_restore_scan(
    broker: str, options: dict[str, Any], event_loop: bool, expected: float
) -> None:
    app = Celery("redelivered", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = options
    assert redelivered_after(app, event_loop=event_loop) == expected


def killed_workers_messages(app: Celery, n: int) -> tuple[redis.Redis, str, str]:
    """``n`` messages in ``app``'s queue handed out and never acknowledged, as a SIGKILL leaves them, a minute
    past their visibility timeout; returns a Redis client, the transport's key prefix and the queue's key."""
    prefix = unique("unacked") + "."
    app.conf.broker_transport_options = {**(app.conf.broker_transport_options or {}), "global_keyprefix": prefix,
                                         "visibility_timeout": 5}
    queue = app.conf.task_default_queue
    r = redis.Redis.from_url(REDIS_URL)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        with conn.Producer() as producer:
            for i in range(n):
                producer.publish({"n": i}, routing_key=queue, declare=[conn.SimpleQueue(queue).queue])
        for _ in range(n):
            assert channel.basic_get(queue, no_ack=False) is not None  # handed out, never acknowledged
        channel.qos._delivered.clear()  # nothing hands them back at close
    r.zadd(f"{prefix}unacked_index", dict.fromkeys(r.zrange(f"{prefix}unacked_index", 0, -1), time.time() - 60))
    assert r.llen(f"{prefix}{queue}") == 0
    return r, prefix, f"{prefix}{queue}"


def forget(r: redis.Redis, prefix: str) -> None:
    for name in r.scan_iter(f"{prefix}*"):
        r.delete(name)
    r.close()


@pytest.mark.parametrize(("limit", "restored"), [(None, 25), (10, 10)])
def test_one_restore_pass_hands_back_every_message_a_killed_worker_held(
    redis_broker_app: Celery, limit: int | None, restored: int
) -> None:
    # A killed green-pool worker holds a message per slot and its countdowns: kombu's event loop restores them
    # all in one pass (its unacked_restore_limit unset), and so must the timer that stands in for it.
    app = redis_broker_app
    if limit is not None:
        app.conf.broker_transport_options = {"unacked_restore_limit": limit}
    r, prefix, queue = killed_workers_messages(app, 25)
    try:
        with app.connection_for_read() as conn:
            restore_unacked(app, conn, 10.0)
        assert r.llen(queue) == restored
    finally:
        forget(r, prefix)


def test_a_restorer_killed_mid_pass_holds_the_restores_up_one_interval_not_five_minutes(
    redis_broker_app: Celery,
) -> None:
    # A green pool is killed whole, its restore timer with it: mid-pass, it leaves kombu's lock behind.
    app = redis_broker_app
    r, prefix, queue = killed_workers_messages(app, 5)
    dead, stuck = app.connection_for_read(), threading.Event()
    dead.default_channel.qos.restore_by_tag = lambda *a, **k: stuck.wait(30)  # never gets past its first message
    killed = threading.Thread(target=restore_unacked, args=(app, dead, 1.0), daemon=True)
    try:
        killed.start()
        wait_for(lambda: r.exists(f"{prefix}unacked_mutex"), timeout=10)
        assert 0 < r.pttl(f"{prefix}unacked_mutex") <= 1000  # kombu's own: 300 s
        with app.connection_for_read() as conn:
            restore_unacked(app, conn, 1.0)  # still held: this pass skips
            assert r.llen(queue) == 0
            time.sleep(1.2)
            restore_unacked(app, conn, 1.0)
        assert r.llen(queue) == 5
    finally:
        stuck.set()
        killed.join(10)
        dead.release()
        forget(r, prefix)


@pytest.mark.parametrize(("broker", "options", "conf", "event_loop", "expected"), [
    ("redis://h/0", {}, {}, True, 100.0),  # kombu's event loop: a scan every 10 x 10 s
    ("redis://h/0", {}, {}, False, 10.0),  # a green pool: the library's timer, every 10 s
    ("redis://h/0", {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}, {}, True, 1.0),
    ("redis://h/0", {"unacked_mutex_expire": 30}, {}, True, 30),  # as set
    ("redis://h/0", {}, {"idemmail_restore_unacked": False}, True, None),  # the library restores nothing: as kombu
    ("amqp://h//", {}, {}, True, None),
])
def test_a_worker_holds_the_transports_restore_lock_one_restore_period_not_five_minutes(
    tmp_path: Any, broker: str, options: dict[str, Any], conf: dict[str, Any], event_loop: bool,
    expected: float | None
) -> None:
    # A worker killed whole mid-scan leaves kombu's lock held: 300 s by default, and no restore meanwhile.
    app = Celery("lock", broker=broker, set_as_current=False)
    app.conf.update(broker_transport_options=options, idemmail_ledger_url=f"sqlite:///{tmp_path / 'l.sqlite3'}",
                    **conf)
    bound_restore_lock(app, event_loop=event_loop)
    assert app.conf.broker_transport_options.get("unacked_mutex_expire") == expected


def test_the_consumers_redis_channel_takes_the_bounded_restore_lock(redis_broker_app: Celery) -> None:
    app = redis_broker_app
    app.conf.broker_transport_options = {"unacked_restore_interval": 1, "unacked_restore_throttle": 2}
    bound_restore_lock(app, event_loop=True)
    with app.connection_for_read() as conn:  # as the worker's consumer makes its connection, after worker_init
        assert conn.default_channel.qos.unacked_mutex_expire == 2.0
