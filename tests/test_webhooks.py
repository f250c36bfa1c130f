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
from dataclasses import dataclass, field
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
    assert stored.resolution is not None and stored.resolution["from"] == "review"
    assert stored.resolution["by"] == f"webhook:{provider}"


@pytest.mark.parametrize("provider", PROVIDERS)
def test_delivery_event_confirms_a_live_claim_and_the_holder_finds_its_token_stale(
    ledger: Ledger, provider: str
) -> None:
    key = new_key()
    token = claim(ledger, key)
    body = body_for(provider, key, "m-1")

    handle_webhook(provider, signed(provider, body), body, secret=secret_for(provider), ledger=ledger)

    record = ledger.get(key)
    assert record is not None and record.state is State.SENT and record.resolution is not None
    assert record.resolution["from"] == "claimed"
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


# -- malformed requests are 4xx, never a 500 (issue 14) --


def environ_for(body: bytes, length: str | None = None, **headers: str) -> dict[str, Any]:
    environ: dict[str, Any] = {"REQUEST_METHOD": "POST", "wsgi.input": io.BytesIO(body),
                               "CONTENT_LENGTH": str(len(body)) if length is None else length}
    environ.update({"HTTP_" + name.upper().replace("-", "_"): value for name, value in headers.items()})
    return environ


def call_wsgi(app: Any, environ: dict[str, Any]) -> tuple[int, Any]:
    seen: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], object]:
        seen.append(status)
        return lambda data: None

    body = b"".join(app(environ, start_response))
    return int(seen[0].split()[0]), json.loads(body)


@pytest.mark.parametrize("stamp", ["\u00b2\u00b3", "\u0661\u0662\u0663", "9" * 5000, "-5", "1e9", "", " 12"])
def test_a_malformed_timestamp_is_a_401(ledger: Ledger, stamp: str) -> None:
    body = body_for("sendgrid", new_key(), "m")
    app = webhook_app(ledger, "sendgrid", secret=SECRET)
    signature = hmac_headers(body, SECRET)[SIGNATURE_HEADER]
    status, reply = call_wsgi(app, environ_for(body, **{TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: signature}))
    assert status == 401 and "timestamp" in reply["error"]


@pytest.mark.parametrize("length,status", [("\u00b2", 400), ("-1", 400), ("1e3", 400), ("9" * 40, 400), ("", 411)])
def test_a_malformed_content_length_is_a_4xx(ledger: Ledger, length: str, status: int) -> None:
    app = webhook_app(ledger, "postmark", secret=BASIC)
    assert call_wsgi(app, environ_for(b"{}", length))[0] == status


@pytest.mark.parametrize("body", [
    b"[" * 200_000 + b"]" * 200_000,  # past the parser's recursion limit
    b"[" * 40 + b"]" * 40,  # parses, but deeper than MAX_DEPTH
    b'{"RecordType": "Delivery", "MessageID": ' + b"9" * 5000 + b"}",  # past Python's integer digit limit
    b'{"RecordType": "Delivery"' + b"\xff\xfe" + b"}",  # not UTF-8
], ids=["deep-recursion", "too-deep", "huge-number", "not-utf8"])
def test_malformed_json_is_a_400(ledger: Ledger, body: bytes) -> None:
    app = webhook_app(ledger, "postmark", secret=BASIC)
    status, reply = call_wsgi(app, environ_for(body, Authorization=basic(BASIC)["Authorization"]))
    assert status == 400, reply


def test_a_deeply_nested_sns_message_is_a_400(ledger: Ledger) -> None:
    event = ses_event(new_key(), "m")
    event["Message"] = "[" * 100_000 + "]" * 100_000
    body = json.dumps(event).encode()
    status, _ = call_wsgi(webhook_app(ledger, "ses", secret=SECRET), environ_for(body, **hmac_headers(body, SECRET)))
    assert status == 400


def test_keys_and_message_ids_no_ledger_holds_are_not_asked_for(ledger: Ledger) -> None:
    class Watching:
        asked: list[str] = []

        def confirm_sent(self, key: str, *args: Any, **kwargs: Any) -> Any:
            self.asked.append(key)
            raise RecordNotFoundError(key)

    watching = Watching()
    body = json.dumps([sendgrid_event("k" * 5000, "m"), sendgrid_event(new_key(), "m" * 5000),
                       sendgrid_event("bad\nkey", "m")]).encode()
    outcome = handle_webhook("sendgrid", hmac_headers(body, SECRET), body, secret=SECRET,
                             ledger=watching)  # type: ignore[arg-type]
    assert (len(outcome.confirmed), len(outcome.unknown_keys), outcome.ignored) == (0, 2, 1)
    assert watching.asked == []


def test_a_bug_behind_the_app_is_a_500_without_a_traceback(ledger: Ledger) -> None:
    class Broken:
        def confirm_sent(self, *args: Any, **kwargs: Any) -> Any:
            raise KeyError("internal detail")

    body = body_for("sendgrid", new_key(), "m")
    status, reply = call_wsgi(webhook_app(Broken(), "sendgrid", secret=SECRET),  # type: ignore[arg-type]
                              environ_for(body, **hmac_headers(body, SECRET)))
    assert status == 500 and reply == {"error": "internal error; retry later"}


# -- SendGrid's own ECDSA signature, verified with cryptography --

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

from idemmail_celery.webhooks import (  # noqa: E402
    SENDGRID_SIGNATURE_HEADER,
    SENDGRID_TIMESTAMP_HEADER,
    WebhookAuth,
    webhook_asgi_app,
)


@pytest.fixture(scope="module")
def sendgrid_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def public_b64(key: ec.EllipticCurvePrivateKey) -> str:
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(der).decode()


def sendgrid_signed(key: ec.EllipticCurvePrivateKey, body: bytes, stamp: int | None = None) -> dict[str, str]:
    ts = str(int(time.time()) if stamp is None else stamp)
    signature = key.sign(ts.encode() + body, ec.ECDSA(hashes.SHA256()))
    return {SENDGRID_SIGNATURE_HEADER: base64.b64encode(signature).decode(), SENDGRID_TIMESTAMP_HEADER: ts}


def test_sendgrid_ecdsa_signature_confirms(ledger: Ledger, sendgrid_key: ec.EllipticCurvePrivateKey) -> None:
    key = new_key()
    parked(ledger, key)
    body = body_for("sendgrid", key, "sg-1")
    auth = WebhookAuth(sendgrid_public_key=public_b64(sendgrid_key))
    outcome = handle_webhook("sendgrid", sendgrid_signed(sendgrid_key, body), body, auth=auth, ledger=ledger)
    assert len(outcome.confirmed) == 1 and ledger.get(key).state is State.SENT  # type: ignore[union-attr]
    pem = sendgrid_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    assert WebhookAuth(sendgrid_public_key=pem).verify("sendgrid", sendgrid_signed(sendgrid_key, body), body) == "ecdsa"


def test_sendgrid_ecdsa_refusals(ledger: Ledger, sendgrid_key: ec.EllipticCurvePrivateKey) -> None:
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    body = body_for("sendgrid", key, "sg-1")
    auth = WebhookAuth(sendgrid_public_key=public_b64(sendgrid_key))
    other = ec.generate_private_key(ec.SECP256R1())
    good = sendgrid_signed(sendgrid_key, body)
    cases = [
        (sendgrid_signed(sendgrid_key, body), body.replace(b"sg-1", b"sg-2"), "does not match"),
        (sendgrid_signed(other, body), body, "does not match"),
        (sendgrid_signed(sendgrid_key, body, stamp=int(time.time()) - 3600), body, "from now"),
        ({**good, SENDGRID_SIGNATURE_HEADER: "%%%not base64"}, body, "does not match"),
        ({**good, SENDGRID_TIMESTAMP_HEADER: str(int(good[SENDGRID_TIMESTAMP_HEADER]) + 1)}, body, "does not match"),
        ({SENDGRID_SIGNATURE_HEADER: good[SENDGRID_SIGNATURE_HEADER]}, body, "timestamp"),
    ]
    for headers, sent_body, why in cases:
        with pytest.raises(WebhookSignatureError, match=why):
            handle_webhook("sendgrid", headers, sent_body, auth=auth, ledger=ledger)
    assert ledger.get(key) == before


@pytest.mark.parametrize("auth", [
    {"sendgrid_public_key": "not a key"},
    {"sendgrid_public_key": base64.b64encode(b"\x30\x03\x02\x01\x01").decode()},
    {"sns_topic_arns": ["arn:aws:sqs:eu-west-1:123456789012:q"]},
    {"sns_topic_arns": ["*"]},
    {"secret": ""},
])
def test_webhook_auth_refuses_what_cannot_work(auth: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        WebhookAuth(**auth)


def test_an_app_with_nothing_that_authenticates_its_provider_is_refused(ledger: Ledger,
                                                                      sendgrid_key: ec.EllipticCurvePrivateKey) -> None:
    with pytest.raises(ConfigurationError, match="nothing configured"):
        webhook_app(ledger, "postmark", auth=WebhookAuth(sendgrid_public_key=public_b64(sendgrid_key)))
    with pytest.raises(ConfigurationError, match="nothing configured"):
        webhook_asgi_app(ledger, "sendgrid")


# -- SNS's RSA signature, verified with cryptography; the certificate URL pinned --

TOPIC = "arn:aws:sns:eu-west-1:123456789012:ses-events"
CERT_URL = "https://sns.eu-west-1.amazonaws.com/SimpleNotificationService-0123456789abcdef.pem"


@dataclass
class SNSSigner:
    key: rsa.RSAPrivateKey
    pem: bytes
    fetched: list[str] = field(default_factory=list)

    def certificates(self, url: str) -> bytes:
        self.fetched.append(url)
        return self.pem

    def sign(self, message: dict[str, Any], version: str = "1", url: str = CERT_URL) -> dict[str, Any]:
        message = {**message, "SignatureVersion": version, "SigningCertURL": url}
        fields = (["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"]
                  if message["Type"] == "Notification" else
                  ["Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type"])
        text = "".join(f"{name}\n{message[name]}\n" for name in fields if name in message)
        digest = hashes.SHA1() if version == "1" else hashes.SHA256()  # SNS's version 1 is SHA1
        message["Signature"] = base64.b64encode(self.key.sign(text.encode(), padding.PKCS1v15(), digest)).decode()
        return message


def self_signed(key: rsa.RSAPrivateKey, days: tuple[int, int] = (-1, 365)) -> bytes:
    import datetime as dt

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sns.amazonaws.com")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now + dt.timedelta(days=days[0]))
            .not_valid_after(now + dt.timedelta(days=days[1])).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def sns_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def sns(sns_key: rsa.RSAPrivateKey) -> SNSSigner:
    return SNSSigner(sns_key, self_signed(sns_key))


def sns_auth(signer: SNSSigner) -> WebhookAuth:
    return WebhookAuth(sns_topic_arns=[TOPIC], sns_certificates=signer.certificates)


def sns_notification(key: str, message_id: str, **extra: Any) -> dict[str, Any]:
    return {**ses_event(key, message_id), "TopicArn": TOPIC, **extra}


@pytest.mark.parametrize("version", ["1", "2"])
def test_sns_signed_notification_confirms(ledger: Ledger, sns: SNSSigner, version: str) -> None:
    key = new_key()
    parked(ledger, key)
    body = json.dumps(sns.sign(sns_notification(key, "ses-1", Subject="Amazon SES Email Event"), version)).encode()
    outcome = handle_webhook("ses", {}, body, auth=sns_auth(sns), ledger=ledger)
    assert len(outcome.confirmed) == 1 and ledger.get(key).state is State.SENT  # type: ignore[union-attr]
    assert sns.fetched == [CERT_URL]


@pytest.mark.parametrize("url", [
    "http://sns.eu-west-1.amazonaws.com/cert.pem",
    "https://sns.eu-west-1.amazonaws.com.evil.example/cert.pem",
    "https://evil.example/sns.eu-west-1.amazonaws.com/cert.pem",
    "https://sns.us-east-1.amazonaws.com/cert.pem",  # not the topic's region
    "https://user@sns.eu-west-1.amazonaws.com/cert.pem",
    "https://sns.eu-west-1.amazonaws.com:8443/cert.pem",
    "https://sns.eu-west-1.amazonaws.com/cert.txt",
    "https://sns.eu-west-1.amazonaws.com/cert.pem?x=1",
    "https://evil.amazonaws.com/cert.pem",
])
def test_sns_certificate_url_is_pinned_to_sns_in_the_topics_region(ledger: Ledger, sns: SNSSigner, url: str) -> None:
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    body = json.dumps(sns.sign(sns_notification(key, "ses-1"), url=url)).encode()
    with pytest.raises(WebhookSignatureError, match="SigningCertURL"):
        handle_webhook("ses", {}, body, auth=sns_auth(sns), ledger=ledger)
    assert sns.fetched == []  # refused before anything is fetched
    assert ledger.get(key) == before


def test_sns_refusals(ledger: Ledger, sns: SNSSigner, sns_key: rsa.RSAPrivateKey) -> None:
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    signed_message = sns.sign(sns_notification(key, "ses-1"))
    tampered = {**signed_message, "Message": signed_message["Message"].replace("ses-1", "ses-2")}
    other_topic = sns.sign({**sns_notification(key, "ses-1"), "TopicArn": "arn:aws:sns:eu-west-1:999999999999:x"})
    other_key = SNSSigner(rsa.generate_private_key(public_exponent=65537, key_size=2048), sns.pem)
    expired = SNSSigner(sns_key, self_signed(sns_key, days=(-30, -1)))
    cases: list[tuple[dict[str, Any], SNSSigner, str]] = [
        (tampered, sns, "does not match"),
        (other_topic, sns, "TopicArn"),
        (other_key.sign(sns_notification(key, "ses-1")), sns, "does not match"),
        ({**signed_message, "SignatureVersion": "3"}, sns, "SignatureVersion"),
        ({**signed_message, "Signature": "%%%"}, sns, "does not match"),
        (sns.sign(sns_notification(key, "ses-1")), expired, "expired"),
    ]
    for message, signer, why in cases:
        with pytest.raises(WebhookSignatureError, match=why):
            handle_webhook("ses", {}, json.dumps(message).encode(), auth=sns_auth(signer), ledger=ledger)
    assert ledger.get(key) == before


def test_sns_subscription_confirmation_is_verified_then_logged_not_fetched(
    ledger: Ledger, sns: SNSSigner, caplog: pytest.LogCaptureFixture
) -> None:
    message = sns.sign({"Type": "SubscriptionConfirmation", "MessageId": "1", "Token": "tok", "TopicArn": TOPIC,
                        "Message": "You have chosen to subscribe", "SubscribeURL": "https://sns.eu-west-1.amazonaws.com/?Action=ConfirmSubscription",
                        "Timestamp": "2026-01-01T10:00:00.000Z"})
    with caplog.at_level("WARNING", logger="idemmail_celery.webhooks"):
        outcome = handle_webhook("ses", {}, json.dumps(message).encode(), auth=sns_auth(sns), ledger=ledger)
    assert outcome.ignored == 1 and "ConfirmSubscription" in caplog.text
    forged = {**message, "SubscribeURL": "https://evil.example/"}
    with pytest.raises(WebhookSignatureError):
        handle_webhook("ses", {}, json.dumps(forged).encode(), auth=sns_auth(sns), ledger=ledger)


def test_sns_with_basic_auth_too_accepts_either(ledger: Ledger, sns: SNSSigner) -> None:
    auth = WebhookAuth(secret=BASIC, sns_topic_arns=[TOPIC], sns_certificates=sns.certificates)
    key = new_key()
    parked(ledger, key)
    unsigned = json.dumps(sns_notification(key, "ses-1")).encode()
    assert auth.verify("ses", basic(BASIC), unsigned) == "basic"
    assert auth.verify("ses", {}, json.dumps(sns.sign(sns_notification(key, "ses-1"))).encode()) == "sns"
    with pytest.raises(WebhookSignatureError):
        auth.verify("ses", {}, unsigned)


# -- the ASGI app, driven through httpx's ASGI transport (no server, no framework) --


def asgi_post(app: Any, method: str = "POST", body: bytes = b"", headers: dict[str, Any] | None = None) -> Any:
    import asyncio

    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://hooks.test") as client:
            return await client.request(method, "/hooks/ses", content=body, headers=headers or {})

    return asyncio.run(go())


def test_asgi_app_confirms_and_refuses_like_the_wsgi_app(ledger: Ledger, sns: SNSSigner) -> None:
    app = webhook_asgi_app(ledger, "ses", auth=WebhookAuth(secret=BASIC, sns_topic_arns=[TOPIC],
                                                           sns_certificates=sns.certificates), max_body=100_000)
    key = new_key()
    parked(ledger, key)
    before = ledger.get(key)
    body = json.dumps(sns.sign(sns_notification(key, "ses-9"))).encode()

    unsigned = asgi_post(app, body=json.dumps(sns_notification(key, "ses-9")).encode())
    assert unsigned.status_code == 401 and unsigned.headers["www-authenticate"].startswith("Basic ")
    assert asgi_post(app, body=b"[" * 50_000 + b"]" * 50_000, headers=basic(BASIC)).status_code == 400
    assert asgi_post(app, body=b"x" * 100_001, headers=basic(BASIC)).status_code == 413
    assert asgi_post(app, "GET").status_code == 405
    assert asgi_post(app, body=b"{}", headers={**basic(BASIC), "Content-Length": b"\xb2"}).status_code == 400
    assert ledger.get(key) == before

    ok = asgi_post(app, body=body)
    assert ok.status_code == 200 and ok.json() == {"confirmed": 1, "unknown": 0, "ignored": 0}
    assert ledger.get(key).state is State.SENT  # type: ignore[union-attr]


def test_asgi_app_answers_the_lifespan_protocol(ledger: Ledger) -> None:
    import asyncio

    app = webhook_asgi_app(ledger, "postmark", secret=BASIC)
    inbox = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app({"type": "lifespan"}, receive, send))
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
