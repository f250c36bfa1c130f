"""send_email end to end: a real worker, a real Redis broker, the fake provider over real sockets."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

from idemmail_celery import ConfigurationError, InvalidEmail, PermanentSendError, SendNeedsReview, State
from idemmail_celery.email import EmailMessage
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider
from idemmail_celery.testing.smtp_sink import SMTPSink

from .conftest import results


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider(slow_seconds=1.5) as f:
        yield f


@pytest.fixture
def http_env(fake: FakeProvider, worker_env: dict[str, str]) -> dict[str, str]:
    worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY,
                      IDEMMAIL_TEST_PROVIDER_TIMEOUT="0.5")
    return worker_env


def body_sha(html: str) -> str:
    msg = EmailMessage.build(sender="Shop <shop@example.com>", to="ann@example.com", subject="Receipt", html=html)
    return hashlib.sha256(json.dumps(msg.to_payload()).encode()).hexdigest()


def send_email(app_module: Any) -> Any:
    return app_module.app.tasks[TASK_NAME]


def test_same_email_three_times_one_delivery(
    http_env: dict[str, str], fake: FakeProvider, request: pytest.FixtureRequest, start_worker: Any
) -> None:
    app_module = request.getfixturevalue("app_module")
    start_worker("-P", "prefork", "-c", "2")
    task = send_email(app_module)
    kw = {"to": "ann@example.com", "subject": "Receipt", "html": "<p>Thanks</p>", "event_id": "order_4821",
          "template": "receipt"}
    out = results([task.delay(**kw), task.delay(**{**kw, "to": "Ann <ann@EXAMPLE.com>"}), task.delay(**kw)])
    assert fake.delivery_count() == 1
    assert {o["message_id"] for o in out} == {fake.deliveries()[0].message_id}
    assert sorted(o["status"] for o in out) == ["duplicate", "duplicate", "sent"]


def test_provider_accepts_then_drops_connection_retry_with_same_key_delivers_once(
    http_env: dict[str, str], fake: FakeProvider, request: pytest.FixtureRequest, start_worker: Any
) -> None:
    app_module = request.getfixturevalue("app_module")
    start_worker("-P", "prefork", "-c", "1")
    fake.fail_next("drop_after_accept")
    fake.fail_next("500_after_accept")
    task = send_email(app_module)
    out = results([task.delay(to="bob@example.com", subject="Reset", text="link", event_id="reset-1")])[0]
    assert out["status"] == "sent"
    key = out["key"]
    assert fake.attempt_count(key) == 3  # dropped, 500, then the provider replayed its first answer
    assert fake.delivery_count() == 1
    assert out["message_id"] == fake.deliveries()[0].message_id
    record = task.ledger.get(key)
    assert record.state is State.SENT and record.attempts == 3


def test_rewritten_body_on_retry_ships_the_first_body(
    http_env: dict[str, str], fake: FakeProvider, request: pytest.FixtureRequest, start_worker: Any
) -> None:
    app_module = request.getfixturevalue("app_module")
    start_worker("-P", "prefork", "-c", "1")
    fake.fail_next("503_before_accept")  # the first attempt fails before the provider accepts anything
    task = send_email(app_module)
    first = task.delay(to="cat@example.com", subject="Your summary", text="draft one", event_id="sum-7")
    second = task.delay(to="cat@example.com", subject="Your summary", text="an agent's rewrite", event_id="sum-7")
    out = results([first, second])
    assert sorted(o["status"] for o in out) == ["duplicate", "sent"]
    assert fake.delivery_count() == 1
    sent = [a for a in fake.attempts() if a.status == 200]
    assert all(json.loads(a.body)["text"] == "draft one" for a in sent)


def test_invalid_email_fails_at_delay_and_enqueues_nothing(
    http_env: dict[str, str], request: pytest.FixtureRequest
) -> None:
    app_module = request.getfixturevalue("app_module")
    task = send_email(app_module)
    bad = [
        {"to": "ann@example.com", "subject": "Hi\r\nBcc: x@example.com", "text": "t"},
        {"to": [], "subject": "Hi", "text": "t"},
        {"to": "not-an-address", "subject": "Hi", "text": "t"},
        {"to": "ann@example.com", "subject": "Hi", "text": "x" * 200, "headers": {"X": "a\nb"}},
    ]
    for kw in bad:
        with pytest.raises(InvalidEmail):
            task.delay(**kw)
    with pytest.raises(TypeError, match="keyword"):
        task.delay("ann@example.com")
    with app_module.app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(app_module.app.conf.task_default_queue) == 0


def test_missing_provider_setting_fails_at_delay(request: pytest.FixtureRequest) -> None:
    app_module = request.getfixturevalue("app_module")
    with pytest.raises(ConfigurationError, match="idemmail_provider_url"):
        send_email(app_module).delay(to="ann@example.com", subject="Hi", text="t")


def test_invalid_email_reaching_a_worker_ends_failed_not_retried(
    http_env: dict[str, str], fake: FakeProvider, request: pytest.FixtureRequest, start_worker: Any
) -> None:
    app_module = request.getfixturevalue("app_module")
    worker = start_worker("-P", "prefork", "-c", "1")
    # send_task by name skips the caller-side checks, as another service might.
    ar = app_module.app.send_task(TASK_NAME, kwargs={"to": "nobody", "subject": "Hi", "text": "t"})
    out = results([ar])[0]
    assert isinstance(out, PermanentSendError) and out.reason == "invalid_email"
    assert fake.attempt_count() == 0
    assert b"retry:" not in worker.log()


def test_smtp_crash_after_data_is_parked_for_review(
    worker_env: dict[str, str], request: pytest.FixtureRequest, start_worker: Any
) -> None:
    with SMTPSink() as sink:
        worker_env.update(IDEMMAIL_TEST_PROVIDER=sink.url, IDEMMAIL_TEST_PROVIDER_TIMEOUT="2")
        app_module = request.getfixturevalue("app_module")
        start_worker("-P", "prefork", "-c", "1")
        sink.fail_next("drop_after_data")  # the server got the whole message, then the line died
        task = send_email(app_module)
        out = results([task.delay(to="dan@example.com", subject="Invoice", text="due", event_id="inv-9")])[0]
        assert isinstance(out, SendNeedsReview) and out.reason == "after_data"
        assert sink.count() == 1  # it did arrive: a blind resend would have doubled it
        record = task.ledger.get(out.key)
        assert record.state is State.REVIEW
        again = results([task.delay(to="dan@example.com", subject="Invoice", text="due", event_id="inv-9")])[0]
        assert isinstance(again, SendNeedsReview)
        assert sink.count() == 1


@pytest.mark.parametrize("searchable", [True, False])
def test_keyless_provider_ambiguous_send_is_reconciled_or_parked(
    searchable: bool, worker_env: dict[str, str], request: pytest.FixtureRequest, start_worker: Any
) -> None:
    from idemmail_celery.testing.fake_keyless import DEFAULT_POSTMARK_TOKEN, FakeKeylessProvider

    # Postmark has no idempotency key: after a dropped response the worker searches it by the key's tag.
    with FakeKeylessProvider(search_lag_seconds=0.0 if searchable else 3600.0) as keyless:
        worker_env.update(IDEMMAIL_TEST_PROVIDER=f"postmark://?base_url={keyless.url}",
                          IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_POSTMARK_TOKEN)
        app_module = request.getfixturevalue("app_module")
        start_worker("-P", "prefork", "-c", "1")
        keyless.fail_next("drop_after_accept")
        task = send_email(app_module)
        out = results([task.delay(to="eve@example.com", subject="Invoice", text="due", event_id="inv-10")])[0]
        assert keyless.delivery_count() == 1  # never sent twice
        if searchable:  # found by its tag: recorded as sent with the provider's id
            assert out["status"] == "sent" and out["result"]["reconciled"] is True
            assert out["message_id"] == keyless.deliveries()[0].message_id
        else:  # not found (search lags): absence is not proof, so review
            assert isinstance(out, SendNeedsReview) and out.reason == "connection_dropped"
            assert task.ledger.get(out.key).state is State.REVIEW
