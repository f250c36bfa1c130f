"""Delivery webhooks against a real SQLite ledger, and the WSGI app on a real loopback server.

Each test names the behaviour it proves: an authenticated delivery event from
Postmark, SendGrid or SES moves the intent's record from ``review`` (or a live
``claimed``) to ``sent`` with the provider's message id; a request that is not
authenticated, or badly, is refused with :class:`WebhookSignatureError` and the
record is left exactly as it was; the WSGI app answers 401/400/200 accordingly.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import pytest

from idemmail_celery.email import EmailMessage
from idemmail_celery.errors import (
    AmbiguousSendError,
    ConfigurationError,
    IdemmailError,
    LedgerUnavailableError,
    RecordNotFoundError,
    StaleTokenError,
)
from idemmail_celery.ledger import ClaimRequest, Ledger, State, from_url
from idemmail_celery.providers import from_url as provider_from_url
from idemmail_celery.testing.fake_keyless import FakeKeylessProvider
from idemmail_celery.webhooks import (
    SECRET_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookPayloadError,
    WebhookSignatureError,
    evidence,
    handle_webhook,
    hmac_headers,
    reconcile,
    webhook_app,
)

PROVIDERS = ("postmark", "sendgrid", "ses")
BASIC = "hooks:s3cret-basic-password"
SECRET = "whsec-shared-secret-0123456789"


def new_key() -> str:
    return hashlib.sha256(uuid.uuid4().bytes).hexdigest()


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = from_url(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    yield led
    led.close()


def claim(ledger: Ledger, key: str) -> int:
    request = ClaimRequest(key=key, task_name="idemmail_celery.send_email", payload='{"args": []}', fingerprint="fp")
    return ledger.claim(request).token


def parked(ledger: Ledger, key: str) -> int:
    """A record in ``review``, as an ambiguous send leaves it; returns its token."""
    token = claim(ledger, key)
    ledger.park(key, token, {"type": "AmbiguousSendError", "reason": "connection_dropped"})
    record = ledger.get(key)
    assert record is not None and record.state is State.REVIEW
    return record.token


# -- what each provider posts --


def postmark_event(key: str, message_id: str, record_type: str = "Delivery") -> dict[str, Any]:
    return {"RecordType": record_type, "ServerID": 23, "MessageStream": "outbound", "MessageID": message_id,
            "Recipient": "ann@example.com", "Tag": "", "DeliveredAt": "2026-01-01T10:00:00Z",
            "Details": "Test delivery webhook details", "Metadata": {"idemmail_key": key}}


def sendgrid_event(key: str, message_id: str, event: str = "delivered") -> dict[str, Any]:
    return {"email": "ann@example.com", "timestamp": 1767261600, "event": event, "sg_event_id": uuid.uuid4().hex,
            "sg_message_id": message_id, "idemmail_key": key}


def ses_event(key: str, message_id: str, event_type: str = "Delivery") -> dict[str, Any]:
    inner = {"eventType": event_type, "mail": {
        "timestamp": "2026-01-01T10:00:00.000Z", "source": "shop@example.com", "messageId": message_id,
        "destination": ["ann@example.com"],
        "tags": {"ses:configuration-set": ["transactional"], "idemmail_key": [key]}}}
    return {"Type": "Notification", "MessageId": str(uuid.uuid4()), "TopicArn": "arn:aws:sns:eu-west-1:1:ses",
            "Message": json.dumps(inner), "Timestamp": "2026-01-01T10:00:01.000Z"}


def body_for(provider: str, key: str, message_id: str) -> bytes:
    if provider == "postmark":
        return json.dumps(postmark_event(key, message_id)).encode()
    if provider == "sendgrid":
        return json.dumps([sendgrid_event(key, message_id)]).encode()
    return json.dumps(ses_event(key, message_id)).encode()


def basic(credentials: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(credentials.encode()).decode()}


def secret_for(provider: str) -> str:
    return BASIC if provider == "postmark" else SECRET


def signed(provider: str, body: bytes) -> dict[str, str]:
    """How each provider's request arrives authenticated: Postmark basic auth, SendGrid and SES by HMAC."""
    return basic(BASIC) if provider == "postmark" else hmac_headers(body, SECRET)


# -- reconcile: the event's evidence into the ledger --


@pytest.mark.parametrize("provider", PROVIDERS)
def test_signed_delivery_event_moves_review_to_sent_with_the_providers_id(ledger: Ledger, provider: str) -> None:
    key, message_id = new_key(), f"{provider}-msg-{uuid.uuid4().hex[:8]}"
    parked(ledger, key)
    body = body_for(provider, key, message_id)

    outcome = handle_webhook(provider, signed(provider, body), body, secret=secret_for(provider), ledger=ledger)

    [record] = outcome.confirmed
    stored = ledger.get(key)
    assert stored == record and stored.state is State.SENT
    assert stored.result == {"message_id": message_id, "provider": provider, "via": "webhook"}
    assert stored.error is not None and stored.error["resolution"]["from"] == "review"
    assert stored.error["resolution"]["by"] == f"webhook:{provider}"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_delivery_event_confirms_a_live_claim_and_the_holder_finds_its_token_stale(
    ledger: Ledger, provider: str
) -> None:
    key = new_key()
    token = claim(ledger, key)
    body = body_for(provider, key, "m-1")

    handle_webhook(provider, signed(provider, body), body, secret=secret_for(provider), ledger=ledger)

    record = ledger.get(key)
    assert record is not None and record.state is State.SENT and record.error is not None
    assert record.error["resolution"]["from"] == "claimed"
    with pytest.raises(StaleTokenError):
        ledger.complete(key, token, {"message_id": "from-the-holder"})
    after = ledger.get(key)
    assert after is not None and after.result is not None and after.result["message_id"] == "m-1"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_unsigned_request_is_refused_and_the_record_unchanged(ledger: Ledger, provider: str) -> None:
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    body = body_for(provider, key, "m-1")

    with pytest.raises(WebhookSignatureError) as info:
        handle_webhook(provider, {"Content-Type": "application/json"}, body, secret=secret_for(provider),
                       ledger=ledger)

    assert isinstance(info.value, IdemmailError) and "unauthenticated" in str(info.value)
    assert ledger.get(key) == before


def _wrong_secret(provider: str, body: bytes) -> dict[str, str]:
    return basic("hooks:guess") if provider == "postmark" else hmac_headers(body, "not-the-secret")


def _stale(provider: str, body: bytes) -> dict[str, str]:
    return basic("hooks:nope") if provider == "postmark" else hmac_headers(body, SECRET,
                                                                            timestamp=int(time.time()) - 3600)


def _malformed(provider: str, body: bytes) -> dict[str, str]:
    if provider == "postmark":
        return {"Authorization": "Basic %%%not-base64"}
    return {TIMESTAMP_HEADER: "yesterday", SIGNATURE_HEADER: "v1=00"}


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("forge", [_wrong_secret, _stale, _malformed], ids=["wrong_secret", "stale", "malformed"])
def test_badly_signed_request_is_refused_and_the_record_unchanged(
    ledger: Ledger, provider: str, forge: Callable[[str, bytes], dict[str, str]]
) -> None:
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    body = body_for(provider, key, "m-1")
    with pytest.raises(WebhookSignatureError) as info:
        handle_webhook(provider, forge(provider, body), body, secret=secret_for(provider), ledger=ledger)
    assert secret_for(provider) not in str(info.value)
    assert ledger.get(key) == before


@pytest.mark.parametrize("provider", ["sendgrid", "ses"])
def test_a_body_changed_after_signing_is_refused(ledger: Ledger, provider: str) -> None:
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    headers = hmac_headers(body_for(provider, key, "m-1"), SECRET)
    forged = body_for(provider, key, "m-forged")
    with pytest.raises(WebhookSignatureError, match="does not match the body"):
        handle_webhook(provider, headers, forged, secret=SECRET, ledger=ledger)
    assert ledger.get(key) == before


def test_sendgrids_own_ecdsa_signature_is_not_taken_for_ours(ledger: Ledger) -> None:
    # Fail closed: a request straight from SendGrid carries ECDSA headers this package does not verify.
    key = new_key()
    parked(ledger, key)
    body = body_for("sendgrid", key, "m-1")
    headers = {"X-Twilio-Email-Event-Webhook-Signature": "MEUCIQ...", "X-Twilio-Email-Event-Webhook-Timestamp": "1"}
    with pytest.raises(WebhookSignatureError):
        handle_webhook("sendgrid", headers, body, secret=SECRET, ledger=ledger)


def test_postmark_custom_header_secret_is_accepted(ledger: Ledger) -> None:
    key = new_key()
    parked(ledger, key)
    body = body_for("postmark", key, "m-1")
    handle_webhook("postmark", {SECRET_HEADER: SECRET}, body, secret=SECRET, ledger=ledger)
    assert ledger.get(key).state is State.SENT  # type: ignore[union-attr]
    with pytest.raises(WebhookSignatureError):
        handle_webhook("postmark", {SECRET_HEADER: "guess"}, body, secret=SECRET, ledger=ledger)


def test_ses_through_sns_basic_auth_is_accepted(ledger: Ledger) -> None:
    key = new_key()
    parked(ledger, key)
    body = body_for("ses", key, "0100-ses-id")
    handle_webhook("ses", basic(BASIC), body, secret=BASIC, ledger=ledger)
    record = ledger.get(key)
    assert record is not None and record.result == {"message_id": "0100-ses-id", "provider": "ses", "via": "webhook"}


def test_secrets_rotate_the_old_one_still_verifies(ledger: Ledger) -> None:
    key = new_key()
    parked(ledger, key)
    body = body_for("sendgrid", key, "m-1")
    handle_webhook("sendgrid", hmac_headers(body, "old-secret"), body, secret=["new-secret", "old-secret"],
                   ledger=ledger)
    assert ledger.get(key).state is State.SENT  # type: ignore[union-attr]


@pytest.mark.parametrize("event", [
    postmark_event("k", "m", record_type="Bounce"),
    {**postmark_event("k", "m"), "Metadata": {}},
    sendgrid_event("k", "m", event="open"),
    {key: value for key, value in sendgrid_event("k", "m").items() if key != "idemmail_key"},
    ses_event("k", "m", event_type="Bounce"),
    {"Type": "SubscriptionConfirmation", "SubscribeURL": "https://sns.example/confirm", "Token": "t"},
    {"something": "else"},
], ids=["postmark_bounce", "postmark_no_key", "sendgrid_open", "sendgrid_no_key", "ses_bounce", "sns_subscribe",
        "unknown"])
def test_events_that_prove_no_delivery_return_none_and_touch_nothing(ledger: Ledger, event: dict[str, Any]) -> None:
    parked(ledger, "k")
    before = ledger.get("k")
    assert evidence(event) is None
    assert reconcile(event, ledger=ledger) is None
    assert ledger.get("k") == before


@pytest.mark.parametrize(("event", "kind"), [
    (sendgrid_event("k", "m", event="processed"), "processed"),
    (json.loads(ses_event("k", "m", event_type="Send")["Message"]), "Send"),  # raw delivery, no SNS envelope
])
def test_acceptance_events_confirm_too(ledger: Ledger, event: dict[str, Any], kind: str) -> None:
    parked(ledger, "k")
    found = evidence(event)
    assert found is not None and found.event == kind and found.key == "k" and found.message_id == "m"
    assert reconcile(event, ledger=ledger) is not None


def test_a_key_the_ledger_does_not_know_is_a_clear_record_not_found(ledger: Ledger) -> None:
    with pytest.raises(RecordNotFoundError) as info:
        reconcile(postmark_event("never-claimed", "pm-42"), ledger=ledger)
    assert "never-claimed" in str(info.value) and "pm-42" in str(info.value) and "postmark" in str(info.value)


def test_a_redelivered_event_leaves_the_sent_record_as_it_is(ledger: Ledger) -> None:
    key = new_key()
    parked(ledger, key)
    first = reconcile(postmark_event(key, "pm-1"), ledger=ledger)
    again = reconcile(postmark_event(key, "pm-1"), ledger=ledger)
    assert first is not None and again == first


def test_a_sendgrid_batch_confirms_reports_and_ignores_per_event(ledger: Ledger) -> None:
    known = new_key()
    parked(ledger, known)
    events = [sendgrid_event(known, "sg-1", "processed"), sendgrid_event(known, "sg-1", "delivered"),
              sendgrid_event(known, "sg-1", "open"), sendgrid_event("stale-key", "sg-2")]
    body = json.dumps(events).encode()
    outcome = handle_webhook("sendgrid", hmac_headers(body, SECRET), body, secret=SECRET, ledger=ledger)
    assert len(outcome.confirmed) == 2 and outcome.unknown_keys == ["stale-key"] and outcome.ignored == 1
    assert ledger.get(known).state is State.SENT  # type: ignore[union-attr]


def test_an_event_of_another_provider_is_a_payload_error(ledger: Ledger) -> None:
    body = json.dumps(postmark_event("k", "m")).encode()
    with pytest.raises(WebhookPayloadError):
        handle_webhook("sendgrid", hmac_headers(body, SECRET), body, secret=SECRET, ledger=ledger)


def test_an_ambiguous_ses_send_is_parked_then_settled_by_its_sns_event(ledger: Ledger) -> None:
    # The whole story for a provider that cannot be searched: drop after accept, park, SNS event, sent.
    with FakeKeylessProvider() as fake:
        creds = fake.aws_credentials
        ses = provider_from_url("ses://eu-west-1", api_key=f"{creds.access_key_id}:{creds.secret_access_key}",
                                base_url=fake.url)
        message = EmailMessage.build(sender="shop@example.com", to="ann@example.com", subject="s", text="t")
        key = new_key()
        token = claim(ledger, key)
        fake.fail_next("drop_after_accept")
        with pytest.raises(AmbiguousSendError):
            ses.send(message, key=key)
        assert ses.find_sent(key) is None
        ledger.park(key, token, {"type": "AmbiguousSendError"})
        [delivery] = fake.deliveries()
        ses.close()

    body = body_for("ses", delivery.key or "", delivery.message_id)
    handle_webhook("ses", hmac_headers(body, SECRET), body, secret=SECRET, ledger=ledger)
    record = ledger.get(key)
    assert record is not None and record.state is State.SENT
    assert record.result is not None and record.result["message_id"] == delivery.message_id
    assert fake.delivery_count(key) == 1


# -- the WSGI app, served by wsgiref on loopback --


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def serve() -> Iterator[Callable[[Any], str]]:
    servers: list[WSGIServer] = []

    def start(app: Any) -> str:
        server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
        servers.append(server)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}/hooks"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("provider", PROVIDERS)
def test_wsgi_app_confirms_a_signed_event_with_200(ledger: Ledger, serve: Callable[[Any], str], provider: str) -> None:
    url = serve(webhook_app(ledger, provider, secret=secret_for(provider)))
    key = new_key()
    parked(ledger, key)
    body = body_for(provider, key, "m-7")
    response = httpx.post(url, content=body, headers={**signed(provider, body), "Content-Type": "application/json"})
    assert response.status_code == 200
    assert response.json() == {"confirmed": 1, "unknown": 0, "ignored": 0}
    assert ledger.get(key).state is State.SENT  # type: ignore[union-attr]


def test_wsgi_app_answers_401_with_a_challenge_400_and_the_rest(ledger: Ledger, serve: Callable[[Any], str]) -> None:
    url = serve(webhook_app(ledger, "postmark", secret=BASIC, max_body=10_000))
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    body = body_for("postmark", key, "m-1")

    unsigned = httpx.post(url, content=body)
    assert unsigned.status_code == 401 and unsigned.headers["www-authenticate"].startswith("Basic ")
    assert "error" in unsigned.json()
    assert httpx.post(url, content=body, headers=basic("hooks:guess")).status_code == 401
    not_json = httpx.post(url, content=b"{not json", headers=basic(BASIC))
    assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
    assert httpx.post(url, content=b"[1, 2]", headers=basic(BASIC)).status_code == 400
    assert httpx.get(url).status_code == 405
    assert httpx.post(url, content=b"x" * 10_001, headers=basic(BASIC)).status_code == 413
    assert ledger.get(key) == before

    unknown = httpx.post(url, content=body_for("postmark", "no-such-key", "m"), headers=basic(BASIC))
    assert unknown.status_code == 200 and unknown.json() == {"confirmed": 0, "unknown": 1, "ignored": 0}


def test_wsgi_app_for_hmac_providers_sends_no_basic_challenge(ledger: Ledger, serve: Callable[[Any], str]) -> None:
    url = serve(webhook_app(ledger, "sendgrid", secret=SECRET))
    response = httpx.post(url, content=b"[]")
    assert response.status_code == 401 and "www-authenticate" not in response.headers


def test_wsgi_app_answers_503_when_the_ledger_fails_so_the_provider_retries(serve: Callable[[Any], str]) -> None:
    class DownLedger:
        def confirm_sent(self, *args: Any, **kwargs: Any) -> Any:
            raise LedgerUnavailableError("connection refused")

    url = serve(webhook_app(DownLedger(), "sendgrid", secret=SECRET))  # type: ignore[arg-type]
    body = body_for("sendgrid", new_key(), "m")
    assert httpx.post(url, content=body, headers=hmac_headers(body, SECRET)).status_code == 503


def test_wsgi_app_called_directly_with_an_environ(ledger: Ledger) -> None:
    key = new_key()
    parked(ledger, key)
    body = body_for("ses", key, "m-9")
    headers = hmac_headers(body, SECRET)
    environ = {"REQUEST_METHOD": "POST", "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "text/plain",
               "wsgi.input": io.BytesIO(body),
               "HTTP_X_IDEMMAIL_TIMESTAMP": headers[TIMESTAMP_HEADER],
               "HTTP_X_IDEMMAIL_SIGNATURE": headers[SIGNATURE_HEADER]}
    seen: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], object]:
        seen.append(status)
        return lambda data: None

    chunks = webhook_app(ledger, "ses", secret=SECRET)(environ, start_response)
    assert seen == ["200 OK"] and json.loads(b"".join(chunks)) == {"confirmed": 1, "unknown": 0, "ignored": 0}


@pytest.mark.parametrize(("provider", "secret"), [("mailgun", SECRET), ("postmark", ""), ("sendgrid", [])])
def test_webhook_app_refuses_bad_configuration(ledger: Ledger, provider: str, secret: Any) -> None:
    with pytest.raises(ConfigurationError):
        webhook_app(ledger, provider, secret=secret)
