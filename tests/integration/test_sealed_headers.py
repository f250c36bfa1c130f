"""Headers the worker acts on are sealed (issue 24), with real workers on the Redis broker.

Each test publishes what a broker publisher without the key secret can: ``app.send_task`` by name with
crafted headers, or a queued message's headers copied onto other arguments. None of it decides anything:
nothing is recorded that did not happen, nothing is sent twice, and the victim's own later send is
delivered (never answered ``duplicate``). During a key-secret rotation deployed web processes first, a
worker that cannot check a newer secret's seal waits for one that can instead of choosing a key itself.
"""

from __future__ import annotations

import json
from typing import Any

from idemmail_celery import PermanentSendError
from idemmail_celery.bulk import CAMPAIGN_TASK
from idemmail_celery.chain import (
    CAMPAIGN_HEADER,
    INFLIGHT_HEADER,
    KEY_HEADER,
    OLDER_KEYS_HEADER,
    OUTAGE_HEADER,
    OWNER_HEADER,
    VERDICT_HEADER,
)
from idemmail_celery.keys import secret_ids
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import FakeProvider

from ..conftest import wait_for
from .conftest import results

VICTIM = ("kim@example.com", 21)


def keys_delivered(sink: Any) -> list[str]:
    return sorted(d.split("|")[0] for d in sink.deliveries())


def test_a_forged_verdict_records_nothing_and_the_victims_own_send_is_delivered(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    worker = start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    victims = send.intent_key(*VICTIM)
    forged_sent = {"state": "sent", "result": {"value": {"message_id": "made-up"}, "message_id": "made-up"}}
    forged_review = {"state": "review", "error": {"type": "X", "message": "m", "reason": "r"}}
    out = results([
        app_module.app.send_task(send.name, VICTIM, headers={KEY_HEADER: victims, VERDICT_HEADER: forged_sent}),
        app_module.app.send_task(send.name, ("eve@example.com", 66), headers={VERDICT_HEADER: forged_review}),
    ])
    # The verdicts are ignored: each message is an ordinary call, sent under the key its own arguments make.
    assert out[0]["status"] == "sent" and out[0]["key"] == send.key_builder.explicit_key(victims) != victims
    assert out[1]["status"] == "sent" and out[1]["key"] == send.intent_key("eve@example.com", 66)
    assert send.ledger.get(victims) is None  # nothing recorded under the victim's key
    own = results([send.delay(*VICTIM)])[0]
    assert own["status"] == "sent" and own["key"] == victims
    assert keys_delivered(sink) == sorted([victims, out[0]["key"], out[1]["key"]])
    assert worker.log().count(b"did not seal for it") == 2  # one WARNING per delivery, with its task id


def test_a_key_and_seal_copied_onto_other_arguments_do_not_reach_the_victims_record(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    victims = send.intent_key(*VICTIM)
    queued = send.intent_headers(VICTIM, {})  # what the victim's message carries on the broker
    replay = results([app_module.app.send_task(send.name, ("eve@example.com", 21), headers=queued)])[0]
    assert replay["status"] == "sent" and replay["key"] == send.key_builder.explicit_key(victims)
    own = results([send.delay(*VICTIM)])[0]
    assert own["status"] == "sent" and own["key"] == victims
    assert len(sink.deliveries()) == 2


def test_a_forged_owner_does_not_take_a_live_claim(app_module: Any, sink: Any, start_worker: Any) -> None:
    """The owner string ``ledger show`` prints, put on a message by name: it resumed a live claim and sent.
    Now the message waits on the claim like any copy; the holder records its send and the copy is a duplicate."""
    start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    victims = send.intent_key(*VICTIM)
    led = send.ledger
    held = led.claim(ClaimRequest(key=victims, task_name=send.name, fingerprint="", lease_seconds=300,
                                  payload=send.key_builder.payload(VICTIM, {}).to_json()))
    assert held.status is ClaimStatus.ACQUIRED
    forged = app_module.app.send_task(send.name, VICTIM, headers={OWNER_HEADER: held.record.owner,
                                                                  INFLIGHT_HEADER: 0, OUTAGE_HEADER: 0})
    wait_for(lambda: forged.state in ("RETRY", "SUCCESS"), timeout=60)
    assert forged.state == "RETRY" and sink.deliveries() == []  # waiting on the claim, not resuming it
    led.complete(victims, held.token, {"value": {"message_id": "by-the-holder"}, "message_id": "by-the-holder"})
    out = results([forged])[0]
    assert out["status"] == "duplicate" and out["key"] == victims
    assert sink.deliveries() == []  # the holder's send (recorded above) is the only one


def test_forged_older_keys_move_nothing_onto_another_intents_record(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    other = send.intent_key("lee@example.com", 5)
    first = results([send.delay("lee@example.com", 5)])[0]
    assert first["status"] == "sent"
    many = [other] + [f"{i:064x}" for i in range(20_000)]
    out = results([app_module.app.send_task(send.name, VICTIM, headers={OLDER_KEYS_HEADER: many})])[0]
    assert out["status"] == "sent" and out["key"] == send.intent_key(*VICTIM)  # its own record, not lee's
    assert keys_delivered(sink) == sorted([other, out["key"]])


def test_rotation_with_web_processes_first_sends_once_under_the_secret_the_workers_hold(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    """Web processes on ["two", "test-secret"], a worker still on "test-secret". The web process used to seal
    under "two", which the old worker cannot check (it republished the message until an upgraded worker
    came). Now the web process reads the roster: a live worker lacks "two", so it makes keys and seals under
    "test-secret", and the old worker sends at once; once only upgraded workers are left, "two" is used,
    and a copy made then finds the intent under its older key."""
    old = start_worker("-P", "prefork", "-c", "1")
    send = app_module.send
    before = send.intent_key(*VICTIM)
    send.app.conf.idemmail_key_secret = ["two", "test-secret"]
    send._idem_settings = send._idem_builder = send._idem_handler = None  # the caller is upgraded
    out = results([send.delay(*VICTIM), send.delay(*VICTIM)], timeout=120)
    assert sorted(o["status"] for o in out) == ["duplicate", "sent"] and {o["key"] for o in out} == {before}
    assert b"does not have" not in old.log()
    start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_KEY_SECRETS": "two,test-secret"})
    old.stop()  # the rolling deploy ends: every live worker holds "two"
    wait_for(lambda: send.key_builder.seal({}, send.key_builder.payload((), {})).startswith(
        secret_ids(b"two")[0]), timeout=60)
    later = send.intent_headers(VICTIM)
    assert later["idempotency_key"] != before and later[OLDER_KEYS_HEADER] == [before]
    again = results([send.apply_async(VICTIM, headers=later)], timeout=120)[0]
    assert again["status"] == "duplicate" and again["key"] == before
    assert keys_delivered(sink) == [before]
    record = send.ledger.get(before)
    assert record is not None and record.state is State.SENT


def test_rotation_with_workers_first_sends_once(app_module: Any, sink: Any, start_worker: Any) -> None:
    start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_KEY_SECRETS": "two,test-secret"})
    send = app_module.send
    out = results([send.delay(*VICTIM), send.delay(*VICTIM)])  # the caller still on "test-secret" alone
    assert sorted(o["status"] for o in out) == ["duplicate", "sent"]
    [key] = {o["key"] for o in out}  # a new record goes under the newest secret's key; an older one is found
    assert keys_delivered(sink) == [key]


# -- send_email and send_campaign, with the fake provider over real sockets --

KIM = {"to": "kim@example.com", "subject": "Your receipt", "text": "Thanks", "event_id": "order-21"}


def test_a_forged_sent_verdict_on_send_email_is_ignored_and_the_send_is_real(
    fake_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    """``send_task(send_email, kwargs=victim, headers={"idemmail_verdict": {"state": "sent", ...}})`` recorded the
    victim's intent as sent with a made-up message id and sent nothing; the victim's own delay() then answered
    duplicate. Now the message is an ordinary call: what it records is the provider's real answer."""
    start_worker("-P", "prefork", "-c", "1")
    task = fake_app.app.tasks[TASK_NAME]
    forged = {"state": "sent", "result": {"value": {"message_id": "made-up"}, "message_id": "made-up"}}
    first = results([fake_app.app.send_task(TASK_NAME, kwargs=KIM, headers={VERDICT_HEADER: forged})])[0]
    own = results([task.delay(**KIM)])[0]
    assert first["status"] == "sent" and own["status"] == "duplicate" and first["key"] == own["key"]
    assert fake.delivery_count() == 1 and own["message_id"] == fake.deliveries()[0].message_id != "made-up"


def test_a_forged_review_verdict_skips_no_check_and_stores_nothing(
    fake_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    """With ``"state": "review"`` the worker skipped its checks and stored an unvalidated payload (two addresses
    in ``to``, a CRLF in the subject, over the size cap). Now the checks run and refuse it, storing nothing."""
    worker = start_worker("-P", "prefork", "-c", "1")
    review = {"state": "review", "error": {"type": "X", "message": "m", "reason": "r"}}
    over = 10 * 1024 * 1024 + 1024  # over the size cap, under what the worker refuses before the pool (issue 35)
    calls = [{**KIM, "subject": "Hi\r\nBcc: eve@example.com"}, {**KIM, "text": "x" * over},
             {**KIM, "headers": {f"X-H{i}": "v" for i in range(60)}}]
    out = results([fake_app.app.send_task(TASK_NAME, kwargs=kw, headers={VERDICT_HEADER: review}) for kw in calls])
    for o in out:
        assert isinstance(o, PermanentSendError) and o.reason == "invalid_email", o
    assert fake_app.app.tasks[TASK_NAME].ledger.get(fake_app.app.tasks[TASK_NAME].intent_key(**KIM)) is None
    assert fake.delivery_count() == 0 and worker.log().count(b"did not seal for it") == 3


def test_a_chained_cause_quoting_an_address_reaches_no_result_backend_or_log(
    fake_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    worker = start_worker("-P", "prefork", "-c", "1")
    address = "hidden.person@example.org"
    failed = fake_app.app.send_task(TASK_NAME, kwargs={**KIM, "tags": {f"to {address}": "v"}})
    out = results([failed])[0]
    assert isinstance(out, PermanentSendError) and out.reason == "invalid_email"
    # The chained InvalidEmail may stay: its text is scrubbed where it is made (the name reads 'to <address>').
    assert failed.traceback and address not in failed.traceback and "example.org" not in failed.traceback
    wait_for(lambda: b"invalid_email" in worker.log() or b"PermanentSendError" in worker.log(), timeout=30)
    assert address.encode() not in worker.log() and fake.delivery_count() == 0


def test_a_forged_verdict_on_a_campaign_records_nothing(fake_app: Any, fake: FakeProvider, start_worker: Any) -> None:
    start_worker("-P", "prefork", "-c", "1")
    send_email = fake_app.app.tasks[TASK_NAME]
    key = send_email.intent_key(to="kim@example.com", event_id="nov")
    forged = {key: {"state": "sent", "result": {"value": {"message_id": "made-up"}, "message_id": "made-up"},
                    "owner": "o:1"}}
    out = results([fake_app.app.send_task(CAMPAIGN_TASK, kwargs={
        "campaign_id": "nov", "recipients": ["kim@example.com", "lee@example.com"], "subject": "Nov", "text": "news",
    }, headers={VERDICT_HEADER: forged, OWNER_HEADER: "o:1", CAMPAIGN_HEADER: {"from": 2, "tally": {}}})])[0]
    assert out["sent"] == 2 and out["total"] == 2
    assert fake.delivery_count() == 2
    record = send_email.ledger.get(key)
    assert record is not None and record.state is State.SENT and "made-up" not in json.dumps(record.result)
