"""The Celery adapter's own rules: countdowns below the visibility timeout, budgets per chain,
Celery's retry attributes honoured."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Retry

from idemmail_celery import IdempotentTask
from idemmail_celery.chain import (
    DUE_HEADER,
    ENQUEUED_HEADER,
    HOP_HEADER,
    INFLIGHT_HEADER,
    KEY_HEADER,
    KEY_MARK_HEADER,
    NOT_BEFORE_HEADER,
    OLDER_KEYS_HEADER,
    OUTAGE_HEADER,
    OWNER_HEADER,
    VERDICT_HEADER,
    Carry,
    next_headers,
)
from idemmail_celery.keys import Payload, Seal
from idemmail_celery.republish import Republisher

from .conftest import REDIS_URL, unique


def make_app(broker: str, **transport: Any) -> Celery:
    app = Celery("adapter", broker=broker, set_as_current=False)
    app.conf.update(idemmail_ledger_url="sqlite://", idemmail_key_secret="s", broker_transport_options=transport)
    return app


@pytest.mark.parametrize(("broker", "options", "cap"), [
    ("redis://127.0.0.1:6379/0", {"visibility_timeout": 10}, 5.0),
    ("redis://127.0.0.1:6379/0", {}, 1800.0),  # kombu's default: one hour
    ("sqs://", {"visibility_timeout": 30}, 15.0),
    ("amqp://guest:guest@127.0.0.1:5672//", {"visibility_timeout": 10}, None),  # AMQP never redelivers a held one
])
def test_every_countdown_stays_below_the_visibility_timeout(broker: str, options: dict[str, Any],
                                                            cap: float | None) -> None:
    app = make_app(broker, **options)

    @app.task(base=IdempotentTask, name="adapter.t", shared=False)
    def t(to: str) -> None: ...

    headers: dict[str, Any] = {KEY_HEADER: "k"}
    before = time.time()
    countdown = Republisher(t).split(7200.0, headers)
    if cap is None:
        assert countdown == 7200.0 and NOT_BEFORE_HEADER not in headers
    else:
        assert countdown == cap
        assert float(headers[NOT_BEFORE_HEADER]) == pytest.approx(before + 7200.0, abs=2)  # the rest hops
    assert headers[HOP_HEADER]  # every publish has an id of its own
    short: dict[str, Any] = {NOT_BEFORE_HEADER: "1"}
    assert Republisher(t).split(1.0, short) == 1.0 and NOT_BEFORE_HEADER not in short


def test_a_retry_starts_a_new_chain_and_a_reschedule_keeps_its_budgets() -> None:
    headers = {KEY_HEADER: "k", ENQUEUED_HEADER: "1.0", INFLIGHT_HEADER: 7, OUTAGE_HEADER: 3, OWNER_HEADER: ["o:1"],
               VERDICT_HEADER: {"state": "sent"}, HOP_HEADER: "h", NOT_BEFORE_HEADER: "9"}
    retry = next_headers(headers, Carry(owners=("o:2",)), keep=False)
    assert retry == {KEY_HEADER: "k", ENQUEUED_HEADER: "1.0", OWNER_HEADER: ["o:2"]}  # budgets count per chain
    again = next_headers(headers, Carry(inflight=8, outage=3), keep=True)
    assert again == {KEY_HEADER: "k", ENQUEUED_HEADER: "1.0", INFLIGHT_HEADER: 8, OUTAGE_HEADER: 3}


def test_celerys_retry_attributes_set_the_curve_of_transient_retries() -> None:
    app = make_app("memory://")

    @app.task(base=IdempotentTask, name="adapter.celery_curve", shared=False, retry_backoff=3, retry_backoff_max=20,
              retry_jitter=False)
    def curve(to: str) -> None: ...

    @app.task(base=IdempotentTask, name="adapter.own_curve", shared=False)
    def own(to: str) -> None: ...

    p = curve.policy
    assert (p.retry_backoff, p.retry_backoff_max, p.retry_jitter) == (3.0, 20.0, False)
    assert [curve.handler.retry_countdown(n) for n in range(4)] == [3.0, 6.0, 12.0, 20.0]
    q = own.policy  # without retry_backoff: the idemmail settings (2 s doubling to 300 s, jittered)
    assert (q.retry_backoff, q.retry_backoff_max, q.retry_jitter) == (2.0, 300.0, True)
    assert 8.0 <= own.handler.retry_countdown(3) <= 16.0


def test_a_retry_keeps_the_key_and_its_mark_and_a_reschedule_too() -> None:
    headers = {KEY_HEADER: "k", KEY_MARK_HEADER: "m", OLDER_KEYS_HEADER: ["o"], INFLIGHT_HEADER: 1}
    for keep in (False, True):
        assert {KEY_HEADER: "k", KEY_MARK_HEADER: "m", OLDER_KEYS_HEADER: ["o"]}.items() <= next_headers(
            headers, Carry(), keep=keep).items()


def test_a_bodys_own_retry_is_published_with_its_key_marked(
        redis_broker_app: Celery) -> None:
    """The body calls ``self.retry()``. The copy published to the broker carries the same key, marked:
    apply_async would otherwise take the key for a caller's own and hash it (a second key for one intent)."""
    app = redis_broker_app
    queue = app.conf.task_default_queue
    r = redis.Redis.from_url(REDIS_URL)

    @app.task(base=IdempotentTask, name=unique("adapter.retrying"), shared=False, bind=True)
    def retrying(self: Any, to: str) -> None:
        raise self.retry(countdown=0)

    key = retrying.intent_key("ann@example.com")
    call = Payload(["ann@example.com"], {})
    # What Celery's tracer does for a delivery: push the request, call the task.
    # This delivery had been rescheduled 7 times waiting on another holder and 3 times on an outage.
    retrying.push_request(id="delivery-1", args=["ann@example.com"], kwargs={},
                          headers=retrying.sealed({**retrying.key_headers(key, call), INFLIGHT_HEADER: 7,
                                                   OUTAGE_HEADER: 3}, call),
                          retries=0, is_eager=False, called_directly=False,
                          delivery_info={"exchange": "", "routing_key": queue})
    try:
        with pytest.raises(Retry):
            retrying("ann@example.com")
    finally:
        retrying.pop_request()
    try:
        [raw] = r.lrange(queue, 0, -1)
        headers = json.loads(raw)["headers"]
        assert headers[KEY_HEADER] == key
        assert retrying.key_builder.check_seal(headers, call) is Seal.VALID and KEY_MARK_HEADER in headers
        assert headers["retries"] == 1
        # A retry starts a new reschedule chain: its in-flight and outage budgets start again.
        assert INFLIGHT_HEADER not in headers and OUTAGE_HEADER not in headers
    finally:
        r.close()


def test_a_second_copy_of_one_hop_of_a_long_wait_still_waits(tmp_path: Path) -> None:
    """A wait longer than the visibility timeout travels in hops, and the broker may hand one hop out
    twice. Nobody holds a claim for a waiting message: a copy that dropped itself on a mark set by
    a worker killed before it published would lose the intent. Both copies publish; both waits meet
    at the claim."""
    app = make_app("redis://127.0.0.1:6379/0", visibility_timeout=10)
    app.conf.idemmail_ledger_url = f"sqlite:///{tmp_path / 'l.sqlite3'}"
    ran: list[str] = []

    @app.task(base=IdempotentTask, name=unique("adapter.waits"), shared=False)
    def waits(to: str) -> None:
        ran.append(to)

    call = Payload(["ann@example.com"], {})
    headers = waits.sealed({**waits.intent_headers(("ann@example.com",), {}), HOP_HEADER: "hop-1",
                            NOT_BEFORE_HEADER: f"{time.time() + 3600:.3f}"}, call)  # what a hop publishes
    assert waits.apply(("ann@example.com",), headers=dict(headers)).state == "RETRY"  # the next hop (in-line)
    assert waits.apply(("ann@example.com",), headers=dict(headers)).state == "RETRY"  # the copy waits on too
    assert ran == []
    due = waits.sealed({**headers, NOT_BEFORE_HEADER: f"{time.time() - 1:.3f}"}, call)
    assert waits.apply(("ann@example.com",), headers=dict(due)).state == "SUCCESS"
    assert waits.apply(("ann@example.com",), headers=dict(due)).result["status"] == "duplicate" and ran == [
        "ann@example.com"]


def test_a_reschedule_mark_outlives_the_visibility_timeout() -> None:
    app = make_app("redis://127.0.0.1:6379/0", visibility_timeout=7200)

    @app.task(base=IdempotentTask, name=unique("adapter.marks"), shared=False)
    def t(to: str) -> None: ...

    assert t.policy.hop_ttl_seconds > 2 * 7200  # a copy restored after the timeout still finds the mark
    amqp = make_app("amqp://guest:guest@127.0.0.1:5672//")

    @amqp.task(base=IdempotentTask, name=unique("adapter.amqp"), shared=False)
    def u(to: str) -> None: ...

    assert u.policy.hop_ttl_seconds == 3600.0  # AMQP never hands a held message out again


def test_a_reschedule_says_its_reason_once_and_shows_as_it_in_a_monitor(redis_broker_app: Celery) -> None:
    """A copy meeting another holder's live claim is rescheduled: the worker's log line (``retry: <str>``)
    names the outcome once, and the repr a prefork worker's ``task-retried`` event carries (Flower's
    exception, kept after the copy succeeds) is the reason, not Celery's ``Retry(Retry(...), ...)``."""
    import pickle

    from billiard.einfo import ExceptionWithTraceback

    from idemmail_celery.ledger import ClaimRequest

    app = redis_broker_app

    @app.task(base=IdempotentTask, name=unique("adapter.held"), shared=False)
    def held(to: str) -> None: ...

    key = held.intent_key("ann@example.com")
    held.ledger.claim(ClaimRequest(key=key, task_name=held.name, payload="{}", fingerprint="f", owner="another",
                                   lease_seconds=60))
    headers = held.intent_headers(("ann@example.com",), {})  # sealed, as delay() sends them
    assert headers[KEY_HEADER] == key
    held.push_request(id="delivery-1", args=["ann@example.com"], kwargs={}, headers=headers,
                      retries=0, is_eager=False, called_directly=False,
                      delivery_info={"exchange": "", "routing_key": app.conf.task_default_queue})
    try:
        with pytest.raises(Retry) as info:
            held("ann@example.com")
    finally:
        held.pop_request()
    retry = info.value
    assert str(retry) == f"in_flight: {key} held by another worker, reschedule 1"
    assert repr(retry) == repr(retry.exc) == f"IdempotencyInFlightError('{key} held by another worker, reschedule 1')"
    wrapped = pickle.loads(pickle.dumps(ExceptionWithTraceback(retry, "tb")))  # as a prefork child hands it back
    assert repr(wrapped.exc) == repr(retry.exc)


# -- a plain task's own point of no return (the write-ahead mark, as send_email's providers make it) --

def test_a_plain_task_that_names_its_point_of_no_return_is_marked_resent_or_parked_by_it(tmp_path: Path) -> None:
    """A task whose body calls ``about_to_send`` and says so (``writes_ahead``) gets what the keyless providers
    get: each run is marked before its side effect; a holder that died before its mark is run again by the
    next claimer; one that died after it is parked with the stage it reached. Without a key downstream
    (``carries_key`` False, the default), a plain task's dead holder would otherwise always be parked."""
    from idemmail_celery.ledger import ClaimRequest, State
    from idemmail_celery.ledger.base import new_owner
    from idemmail_celery.providers.base import about_to_send

    app = Celery("adapter", broker="memory://", set_as_current=False)
    app.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", idemmail_key_secret="s")
    ran: list[tuple[int, Any, bool]] = []

    class MarksItsCharge(IdempotentTask):  # type: ignore[misc]
        def writes_ahead(self) -> bool:
            return True

    @app.task(base=MarksItsCharge, name="adapter.charge", shared=False, bind=True)
    def charge(self: Any, order_id: int) -> dict[str, str]:
        key = self.request.idempotency_key
        about_to_send("charge")  # the point after which the card may have been charged
        record = self.ledger.get(key)
        ran.append((order_id, record.mark, record.writes_ahead))
        return {"id": f"ch-{order_id}"}

    def dead_holder(order_id: int, *, marked: bool) -> str:
        key: str = charge.intent_key(order_id)
        c = charge.ledger.claim(ClaimRequest(key=key, task_name=charge.name, fingerprint="", lease_seconds=0.2,
                                             payload=charge.key_builder.payload((order_id,), {}).to_json(),
                                             owner=new_owner("dead"), writes_ahead=True))
        if marked:
            assert charge.ledger.write_ahead(key, c.token, 0.2, "charge") is True
        time.sleep(0.35)
        return key

    assert charge.apply((1,)).get()["status"] == "sent"
    [(_, mark, promised)] = ran
    assert mark is not None and mark.stage == "charge" and promised  # marked before the side effect

    unmarked = dead_holder(2, marked=False)
    assert charge.apply((2,)).get()["status"] == "sent" and [r[0] for r in ran] == [1, 2]
    record = charge.ledger.get(unmarked)
    assert record is not None and record.state is State.SENT and record.reclaims == 1

    marked = dead_holder(3, marked=True)
    parked = charge.apply((3,)).get(propagate=False)
    record = charge.ledger.get(marked)
    assert type(parked).__name__ == "SendNeedsReview" and [r[0] for r in ran] == [1, 2]  # never run again
    assert record is not None and record.state is State.REVIEW and record.error is not None
    assert record.error["reason"] == "lease_expired" and record.error.get("stage") == "charge"


def test_a_countdown_is_sealed_beside_the_enqueue_time_not_in_its_place(tmp_path: Path) -> None:
    """The ledger-loss rule counts from the enqueue: a copy of the same intent enqueued with this one and due
    at once may have been sent before a loss, so a countdown must not make the message look enqueued after
    it (the enqueue time once became the due time, and such a copy was sent again). The retention rule counts
    from the due time, sealed beside it."""
    app = make_app("redis://127.0.0.1:6379/0")
    app.conf.idemmail_ledger_url = f"sqlite:///{tmp_path / 'l.sqlite3'}"

    @app.task(base=IdempotentTask, name=unique("adapter.later"), shared=False)
    def later(to: str) -> None: ...

    before = time.time()
    due = before + 3600
    headers = later.intent_headers(("ann@example.com",), {}, due=due)
    assert before - 0.001 <= float(headers[ENQUEUED_HEADER]) <= time.time() + 0.001  # sealed to the millisecond
    assert headers[DUE_HEADER] == f"{due:.3f}"
    assert DUE_HEADER not in later.intent_headers(("ann@example.com",), {}, due=before - 1)  # already due
    assert later.sealed(headers, Payload(["ann@example.com"], {}))[KEY_MARK_HEADER]  # sealed with the rest


def test_a_copy_of_a_reschedule_whose_publish_never_happened_goes_out_again_as_the_same_hop(
        redis_broker_app: Celery) -> None:
    """The worker publishes a copy's reschedule as a new hop and then says it is out: a second copy of that
    hop drops. A copy whose hop another copy marked without ever publishing (killed in between) goes out
    again as the same hop instead of dropping (the simulator's trace
    hop_marked_before_a_publish_that_never_happened_strands_the_claim)."""
    from celery.exceptions import Ignore

    from idemmail_celery.ledger import ClaimRequest

    app = redis_broker_app
    queue = app.conf.task_default_queue
    r = redis.Redis.from_url(REDIS_URL)

    @app.task(base=IdempotentTask, name=unique("adapter.copies"), shared=False)
    def copies(to: str) -> None: ...

    key = copies.intent_key("ann@example.com")
    copies.ledger.claim(ClaimRequest(key=key, task_name=copies.name, payload="{}", fingerprint="f", owner="another",
                                     lease_seconds=60))
    call = Payload(["ann@example.com"], {})

    def deliver(hop: str) -> dict[str, Any]:
        """One delivery of the message published as ``hop``; the headers of what it published, if anything."""
        r.delete(queue)
        copies.push_request(id="delivery-1", args=["ann@example.com"], kwargs={},
                            headers=copies.sealed({**copies.key_headers(key, call), HOP_HEADER: hop}, call),
                            retries=0, is_eager=False, called_directly=False,
                            delivery_info={"exchange": "", "routing_key": queue})
        try:
            copies("ann@example.com")
        except Retry:
            [raw] = r.lrange(queue, 0, -1)
            return dict(json.loads(raw)["headers"])
        except Ignore:
            assert r.lrange(queue, 0, -1) == []
            return {}
        finally:
            copies.pop_request()
        raise AssertionError("neither rescheduled nor dropped")

    try:
        first = deliver("hop-1")
        assert first[HOP_HEADER] not in ("", "hop-1") and copies.handler.hop_published(key, "hop-1")
        assert deliver("hop-1") == {}  # its second copy drops: the reschedule is out
        assert copies.ledger.mark_hop(key, "hop-2", 60) is True  # marked by a copy killed before it published
        again = deliver("hop-2")
        assert again[HOP_HEADER] == "hop-2" and copies.key_builder.check_seal(again, call) is Seal.VALID
        assert not copies.handler.hop_published(key, "hop-2")
    finally:
        r.close()
