"""Postmark, SendGrid and SES providers against the fake keyless server, over real loopback sockets.

None of the three de-duplicates, so the tests prove what replaces the key: every
message is tagged with the intent key (header and provider metadata), every
answer maps onto the provider contract, an ambiguous send is never mistaken for a
failure, and Postmark's and SendGrid's searches find a tagged message only once
their index has it (None before: absence is not proof). SES cannot be searched.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import idemmail_celery.providers.base as base_module
from idemmail_celery._common import _run_after_fork
from idemmail_celery.email import Attachment, EmailMessage
from idemmail_celery.errors import (
    AmbiguousSendError,
    ConfigurationError,
    PermanentSendError,
    SendError,
    TransientSendError,
)
from idemmail_celery.providers import backend_for, from_url
from idemmail_celery.providers._http import MAX_ERROR_TEXT
from idemmail_celery.providers.base import Provider
from idemmail_celery.providers.postmark import POSTMARK_API_URL, KeylessHTTPProvider, PostmarkProvider
from idemmail_celery.providers.sendgrid import SENDGRID_API_URL, SendGridProvider
from idemmail_celery.providers.ses import AWSCredentials, SESProvider, sign_v4
from idemmail_celery.testing.fake_keyless import FakeKeylessProvider

PROVIDERS = ("postmark", "sendgrid", "ses")
SEARCHABLE = ("postmark", "sendgrid")
LAG = 30.0


class ManualClock:
    """The fake's time: it only moves when a test says so, so search lag is deterministic."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def new_key() -> str:
    return hashlib.sha256(uuid.uuid4().bytes).hexdigest()


def receipt(tags: dict[str, str] | None = None) -> EmailMessage:
    return EmailMessage.build(
        sender="Shop <shop@example.com>", to="Ann <ann@example.com>", cc=["bob@example.com"],
        reply_to="help@example.com", subject="Receipt 4821", text="Thanks!", html="<p>Thanks!</p>",
        headers={"X-Order": "4821"}, tags={"order": "4821"} if tags is None else tags,
        attachments=[Attachment("receipt.txt", b"total: 12.00", "text/plain")],
    )


def api_key_for(fake: FakeKeylessProvider, name: str) -> str:
    creds = fake.aws_credentials
    return {"postmark": fake.postmark_token, "sendgrid": fake.sendgrid_api_key,
            "ses": f"{creds.access_key_id}:{creds.secret_access_key}"}[name]


URLS = {"postmark": "postmark://", "sendgrid": "sendgrid://", "ses": "ses://eu-west-1"}


def make(name: str, base_url: str, api_key: str, **options: Any) -> KeylessHTTPProvider:
    provider = from_url(URLS[name], api_key=api_key, base_url=base_url, timeout=2.0, connect_timeout=1.0, **options)
    assert isinstance(provider, KeylessHTTPProvider)
    return provider


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def fake(clock: ManualClock) -> Iterator[FakeKeylessProvider]:
    with FakeKeylessProvider(search_lag_seconds=LAG, clock=clock) as server:
        yield server


@pytest.fixture(params=PROVIDERS)
def provider(request: pytest.FixtureRequest, fake: FakeKeylessProvider) -> Iterator[KeylessHTTPProvider]:
    p = make(request.param, fake.url, api_key_for(fake, request.param))
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _fresh_auth_log(monkeypatch: pytest.MonkeyPatch) -> None:
    # The auth error is logged once per process and provider; each test starts as a new process would.
    monkeypatch.setattr(base_module, "_logged", set())


@pytest.fixture
def canned() -> Iterator[Callable[[Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, Any]]]], str]]:
    """A one-handler server whose answer a test writes; yields a factory returning its base URL."""
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Callable[[BaseHTTPRequestHandler], tuple[int, dict[str, Any]]]) -> str:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, payload = answer(self)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _any

            def log_message(self, format: str, *args: object) -> None:
                return None

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# -- sending and tagging --


def test_each_provider_sends_once_and_tags_the_key_in_header_and_metadata(
    fake: FakeKeylessProvider, provider: KeylessHTTPProvider
) -> None:
    key = new_key()
    result = provider.send(receipt(), key=key)

    [delivery] = fake.deliveries()
    assert delivery.provider == provider.name
    assert result.message_id == delivery.message_id and result.provider == provider.name
    assert delivery.key == key  # Metadata / custom_args / EmailTags
    assert delivery.header_key == key  # X-Idemmail-Key in the email itself
    assert fake.delivery_count(key) == 1
    assert provider.accepts_idempotency_key is False
    assert "ann@example.com" in " ".join(delivery.recipients) and "bob@example.com" in " ".join(delivery.recipients)


def test_a_second_send_of_the_same_key_is_a_second_email(fake: FakeKeylessProvider,
                                                         provider: KeylessHTTPProvider) -> None:
    # Why these providers must never resend an ambiguous attempt: nothing downstream drops the copy.
    key = new_key()
    provider.send(receipt(), key=key)
    provider.send(receipt(), key=key)
    assert fake.delivery_count(key) == 2


def test_postmark_body_has_postmarks_shape(fake: FakeKeylessProvider) -> None:
    provider = make("postmark", fake.url, fake.postmark_token, message_stream="receipts")
    key = new_key()
    provider.send(receipt(), key=key)
    body = fake.deliveries()[0].payload
    assert body["From"] == "Shop <shop@example.com>" and body["To"] == "Ann <ann@example.com>"
    assert body["Cc"] == "bob@example.com" and body["ReplyTo"] == "help@example.com"
    assert (body["TextBody"], body["HtmlBody"]) == ("Thanks!", "<p>Thanks!</p>")
    assert body["Metadata"] == {"order": "4821", "idemmail_key": key}
    assert body["Headers"] == [{"Name": "X-Order", "Value": "4821"}, {"Name": "X-Idemmail-Key", "Value": key}]
    assert body["MessageStream"] == "receipts"
    [attachment] = body["Attachments"]
    assert attachment["Name"] == "receipt.txt" and base64.b64decode(attachment["Content"]) == b"total: 12.00"
    [seen] = fake.requests()
    assert seen.headers["x-postmark-server-token"] == "<redacted>"  # it was sent (and matched)


def test_sendgrid_body_has_sendgrids_shape(fake: FakeKeylessProvider) -> None:
    provider = make("sendgrid", fake.url, fake.sendgrid_api_key)
    key = new_key()
    provider.send(receipt(), key=key)
    body = fake.deliveries()[0].payload
    [person] = body["personalizations"]
    assert person["custom_args"] == {"idemmail_key": key}
    assert person["to"] == [{"email": "ann@example.com", "name": "Ann"}]
    assert person["cc"] == [{"email": "bob@example.com"}]
    assert body["from"] == {"email": "shop@example.com", "name": "Shop"}
    assert body["reply_to"] == {"email": "help@example.com"}
    assert [c["type"] for c in body["content"]] == ["text/plain", "text/html"]
    assert body["headers"] == {"X-Order": "4821", "X-Idemmail-Key": key}
    assert body["custom_args"] == {"order": "4821"}
    assert fake.requests()[0].headers["authorization"] == "Bearer <redacted>"


def test_ses_body_has_ses_v2_shape_and_a_sigv4_authorization(fake: FakeKeylessProvider) -> None:
    provider = make("ses", fake.url, api_key_for(fake, "ses"), configuration_set="transactional")
    key = new_key()
    provider.send(receipt(), key=key)
    body = fake.deliveries()[0].payload
    assert body["FromEmailAddress"] == "Shop <shop@example.com>"
    assert body["Destination"] == {"ToAddresses": ["Ann <ann@example.com>"], "CcAddresses": ["bob@example.com"]}
    assert body["EmailTags"] == [{"Name": "order", "Value": "4821"}, {"Name": "idemmail_key", "Value": key}]
    assert body["ConfigurationSetName"] == "transactional"
    simple = body["Content"]["Simple"]
    assert simple["Subject"]["Data"] == "Receipt 4821" and simple["Body"]["Text"]["Data"] == "Thanks!"
    assert {"Name": "X-Idemmail-Key", "Value": key} in simple["Headers"]

    [seen] = fake.requests()
    assert re.fullmatch(
        r"AWS4-HMAC-SHA256 Credential=AKIDFAKEKEYLESS/\d{8}/eu-west-1/ses/aws4_request, "
        r"SignedHeaders=content-type;host;x-amz-date, Signature=[0-9a-f]{64}",
        seen.headers["authorization"],
    )
    assert re.fullmatch(r"\d{8}T\d{6}Z", seen.headers["x-amz-date"])
    assert fake.aws_credentials.secret_access_key not in repr(seen)


def test_ses_with_the_wrong_secret_fails_the_signature_check_and_sends_nothing(fake: FakeKeylessProvider) -> None:
    # The fake recomputes the signature: a wrong secret cannot pass, so the check is real.
    provider = make("ses", fake.url, f"{fake.aws_credentials.access_key_id}:not-the-secret")
    with pytest.raises(TransientSendError) as info:
        provider.send(receipt(), key=new_key())
    assert info.value.reason == "auth" and "SignatureDoesNotMatch" in str(info.value)
    assert "not-the-secret" not in str(info.value)
    assert fake.delivery_count() == 0


def test_ses_session_token_is_sent_and_signed(fake: FakeKeylessProvider) -> None:
    creds = fake.aws_credentials
    provider = make("ses", fake.url, f"{creds.access_key_id}:{creds.secret_access_key}:the-session-token")
    provider.send(receipt(), key=new_key())
    [seen] = fake.requests()
    assert seen.headers["x-amz-security-token"] == "the-session-token"
    assert "x-amz-security-token" in seen.headers["authorization"]
    assert "the-session-token" not in repr(provider)


def test_ses_refuses_tags_ses_cannot_carry_before_sending(fake: FakeKeylessProvider) -> None:
    provider = make("ses", fake.url, api_key_for(fake, "ses"))
    with pytest.raises(PermanentSendError) as info:
        provider.send(receipt(tags={"order": "4821 / paid"}), key=new_key())
    assert info.value.reason == "rejected"
    with pytest.raises(PermanentSendError):
        provider.send(receipt(), key="order-4821:confirm")  # ':' is not allowed in an SES tag value
    assert fake.requests() == []


@pytest.mark.parametrize(("method", "url", "expected"), [
    ("GET", "https://example.amazonaws.com/", "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"),
    ("POST", "https://example.amazonaws.com/", "5da7c1a2acd57cee7505fc6676e4e544621c30862966e37dddb68e92efbe5d6b"),
    ("GET", "https://example.amazonaws.com/?Param2=value2&Param1=value1",
     "b97d918cfa904a5beff61c982a1b6f458b799221646efd99d3219ec94cdf2500"),
])
def test_sign_v4_reproduces_the_aws_test_suite(method: str, url: str, expected: str) -> None:
    # get-vanilla, post-vanilla and get-vanilla-query-order-key-case from AWS's SigV4 test suite.
    credentials = AWSCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    headers = {"Host": "example.amazonaws.com", "X-Amz-Date": "20150830T123600Z"}
    authorization = sign_v4(method, url, headers, b"", credentials=credentials, region="us-east-1", service="service")
    assert authorization == (
        "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/service/aws4_request, "
        f"SignedHeaders=host;x-amz-date, Signature={expected}"
    )


# -- how answers map onto the contract --


@pytest.mark.parametrize(("fault", "error", "reason", "delivered"), [
    ("401", TransientSendError, "auth", 0),
    ("422", PermanentSendError, "rejected", 0),
    ("429", TransientSendError, "rate_limited", 0),
    ("503_before_accept", AmbiguousSendError, "http_503", 0),  # a 5xx cannot say whether it accepted
    ("500_after_accept", AmbiguousSendError, "http_500", 1),
    ("drop_after_accept", AmbiguousSendError, "connection_dropped", 1),
])
def test_each_answer_maps_onto_the_provider_contract(
    fake: FakeKeylessProvider, provider: KeylessHTTPProvider, fault: str, error: type[SendError], reason: str,
    delivered: int,
) -> None:
    key = new_key()
    fake.fail_next(fault)
    with pytest.raises(SendError) as info:
        provider.send(receipt(), key=key)
    assert type(info.value) is error
    assert info.value.reason == reason and info.value.key == key
    assert fake.delivery_count(key) == delivered
    if fault == "429":
        assert isinstance(info.value, TransientSendError) and info.value.retry_after == 7.0


def test_a_message_the_provider_refuses_is_permanent(fake: FakeKeylessProvider, provider: KeylessHTTPProvider) -> None:
    # No fault injected: the fake validates like the provider (the Bcc-only message has no To for SendGrid).
    message = EmailMessage.build(sender="shop@example.com", to=(), bcc="audit@example.com", subject="s", text="t")
    if provider.name == "sendgrid":
        with pytest.raises(PermanentSendError) as info:
            provider.send(message, key=new_key())
        assert info.value.reason == "rejected" and "personalizations" in str(info.value)
    else:
        provider.send(message, key=new_key())
        assert fake.delivery_count() == 1


def test_wrong_credentials_are_transient_auth_and_logged_once(
    fake: FakeKeylessProvider, caplog: pytest.LogCaptureFixture
) -> None:
    provider = make("postmark", fake.url, "wrong-token")
    with caplog.at_level(logging.ERROR, logger="idemmail_celery.providers.postmark"):
        for _ in range(2):
            with pytest.raises(TransientSendError) as info:
                provider.send(receipt(), key=new_key())
            assert info.value.reason == "auth"
    assert len([r for r in caplog.records if "rejected the credentials" in r.getMessage()]) == 1
    assert "wrong-token" not in caplog.text and "wrong-token" not in str(info.value)


@pytest.mark.parametrize("name", PROVIDERS)
def test_connect_refused_is_transient(name: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    provider = make(name, f"http://127.0.0.1:{port}", "a:b")
    with pytest.raises(TransientSendError) as info:
        provider.send(receipt(), key=new_key())
    assert info.value.reason == "connect"


@pytest.mark.parametrize("name", PROVIDERS)
def test_read_timeout_after_the_request_was_written_is_ambiguous(name: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()  # the kernel completes the handshake and buffers the request; nobody answers
        provider = from_url(URLS[name], api_key="a:b", base_url=f"http://127.0.0.1:{listener.getsockname()[1]}",
                            timeout=0.3)
        with pytest.raises(AmbiguousSendError) as info:
            provider.send(receipt(), key=new_key())
        assert info.value.reason == "timeout"
        provider.close()


def test_postmark_2xx_with_an_error_code_is_ambiguous_not_sent(canned: Any) -> None:
    url = canned(lambda h: (200, {"ErrorCode": 406, "Message": "You tried to send to a recipient that has been "
                                  "marked as inactive."}))
    with pytest.raises(AmbiguousSendError) as info:
        make("postmark", url, "t").send(receipt(), key=new_key())
    assert info.value.reason == "unexpected_response" and "ErrorCode 406" in str(info.value)


def test_an_accepted_send_without_an_id_is_still_a_send(canned: Any) -> None:
    url = canned(lambda h: (200, {"ErrorCode": 0, "Message": "OK"}))
    result = make("postmark", url, "t").send(receipt(), key=new_key())
    assert result.message_id == "" and result.provider == "postmark"


def test_a_provider_echoing_the_credential_does_not_leak_it(canned: Any) -> None:
    secret = "pm-SECRET-do-not-leak"
    url = canned(lambda h: (422, {"ErrorCode": 300, "Message": f"bad token {h.headers['X-Postmark-Server-Token']}"}))
    provider = make("postmark", url, secret)
    with pytest.raises(PermanentSendError) as info:
        provider.send(receipt(), key=new_key())
    assert "<credential>" in str(info.value)
    assert secret not in str(info.value) and secret not in repr(info.value) and secret not in repr(provider)
    assert info.value.__cause__ is None  # an httpx error would carry the request and its credential


# A subject with two spaces and a TAB: a provider quoting it, and the provider's own one-line error text,
# put other white space between its words than the message has.
ODD_SUBJECT = "Your  test\tresults are ready, Ann"
QUOTED = {
    "as-sent": ODD_SUBJECT,  # the error text's white space is collapsed before it is shown
    "collapsed": " ".join(ODD_SUBJECT.split()),  # the provider collapsed it itself
    "at-the-cut": "p" * (MAX_ERROR_TEXT - 21) + " " + ODD_SUBJECT,  # across the cut to MAX_ERROR_TEXT
}


@pytest.mark.parametrize("name", PROVIDERS)
@pytest.mark.parametrize("quoted", list(QUOTED))
def test_a_refusal_quoting_the_subject_with_other_white_space_shows_none_of_it(
        canned: Any, name: str, quoted: str) -> None:
    text = f"subject {QUOTED[quoted]} is not allowed"
    url = canned(lambda h: (422, {"ErrorCode": 300, "Message": text, "message": text}))
    message = EmailMessage.build(sender="shop@example.com", to="ann@example.com", subject=ODD_SUBJECT, text="x")
    provider = make(name, url, "AKIDEXAMPLE:wJalrXUtnFEMI-K7MDENG" if name == "ses" else f"{name}-token-0123")
    with pytest.raises(PermanentSendError) as info:
        provider.send(message, key=new_key())
    provider.close()
    shown = f"{info.value} {info.value.args!r}"
    assert "<redacted>" in shown
    for word in ("test", "results", "ready"):
        assert word not in shown, shown


# -- reconciliation: find_sent --


@pytest.mark.parametrize("name", SEARCHABLE)
def test_a_dropped_send_is_ambiguous_then_found_once_the_index_has_it(
    fake: FakeKeylessProvider, clock: ManualClock, name: str
) -> None:
    provider = make(name, fake.url, api_key_for(fake, name))
    key = new_key()
    fake.fail_next("drop_after_accept")
    with pytest.raises(AmbiguousSendError):
        provider.send(receipt(), key=key)
    [delivery] = fake.deliveries()

    assert provider.find_sent(key) is None  # the search index lags: not found is not proof
    clock.advance(LAG - 1)
    assert provider.find_sent(key) is None
    clock.advance(1)
    found = provider.find_sent(key)

    assert found is not None and found.provider == name
    assert found.message_id.startswith(delivery.message_id)  # SendGrid's activity id extends X-Message-Id
    assert found.extra["found_by"] == "search"
    assert fake.delivery_count(key) == 1  # asking sent nothing


@pytest.mark.parametrize("name", SEARCHABLE)
def test_find_sent_does_not_find_another_intents_message(
    fake: FakeKeylessProvider, clock: ManualClock, name: str
) -> None:
    provider = make(name, fake.url, api_key_for(fake, name))
    provider.send(receipt(), key=new_key())
    clock.advance(LAG)
    assert provider.find_sent(new_key()) is None


def test_postmark_search_asks_by_metadata(fake: FakeKeylessProvider) -> None:
    provider = make("postmark", fake.url, fake.postmark_token)
    key = new_key()
    provider.find_sent(key)
    [seen] = fake.requests()
    assert (seen.method, seen.path) == ("GET", "/messages/outbound")
    assert seen.query == {"count": "1", "offset": "0", "metadata_idemmail_key": key}


def test_sendgrid_search_uses_the_activity_query(fake: FakeKeylessProvider) -> None:
    provider = make("sendgrid", fake.url, fake.sendgrid_api_key)
    key = new_key()
    provider.find_sent(key)
    [seen] = fake.requests()
    assert (seen.method, seen.path) == ("GET", "/v3/messages")
    assert seen.query == {"query": f"unique_args['idemmail_key']=\"{key}\"", "limit": "1"}


def test_ses_find_sent_is_none_without_asking(fake: FakeKeylessProvider, clock: ManualClock) -> None:
    provider = make("ses", fake.url, api_key_for(fake, "ses"))
    key = new_key()
    fake.fail_next("drop_after_accept")
    with pytest.raises(AmbiguousSendError):
        provider.send(receipt(), key=key)
    clock.advance(LAG * 10)
    requests_before = len(fake.requests())
    assert provider.find_sent(key) is None  # SES cannot be searched: the SNS event path settles it
    assert len(fake.requests()) == requests_before


@pytest.mark.parametrize("name", SEARCHABLE)
def test_a_search_that_cannot_be_asked_raises_instead_of_claiming_absence(fake: FakeKeylessProvider,
                                                                          name: str) -> None:
    provider = make(name, fake.url, "wrong-credential")
    with pytest.raises(TransientSendError) as info:
        provider.find_sent(new_key())
    assert info.value.reason == "auth"
    assert "wrong-credential" not in str(info.value)


def test_a_search_that_fails_in_transport_is_transient_never_ambiguous() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        provider = from_url("postmark://", api_key="t", base_url=f"http://127.0.0.1:{listener.getsockname()[1]}",
                            timeout=0.3)
        with pytest.raises(TransientSendError) as info:
            provider.find_sent(new_key())
        assert info.value.reason == "search_failed"


def test_postmark_ignores_a_search_result_tagged_with_another_key(canned: Any) -> None:
    # A search that ignored the metadata filter would answer with the latest message: not ours.
    url = canned(lambda h: (200, {"TotalCount": 1, "Messages": [
        {"MessageID": "someone-elses", "Metadata": {"idemmail_key": "another"}}]}))
    assert make("postmark", url, "t").find_sent(new_key()) is None


# -- configuration, credentials, processes --


def test_from_url_builds_each_provider_with_its_real_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    assert backend_for("postmark://") is PostmarkProvider
    assert backend_for("sendgrid://") is SendGridProvider
    assert backend_for("ses://eu-west-1") is SESProvider
    assert from_url("postmark://", api_key="t").base_url == POSTMARK_API_URL  # type: ignore[attr-defined]
    assert from_url("sendgrid://", api_key="t").base_url == SENDGRID_API_URL  # type: ignore[attr-defined]
    ses = from_url("ses://eu-west-1?configuration_set=tx", api_key="a:b")
    assert isinstance(ses, SESProvider)
    assert ses.base_url == "https://email.eu-west-1.amazonaws.com" and ses.configuration_set == "tx"
    query = from_url("postmark://?message_stream=broadcast&base_url=http://localhost:9/&timeout=3", api_key="t")
    assert isinstance(query, PostmarkProvider)
    assert query.message_stream == "broadcast" and query.base_url == "http://localhost:9"


@pytest.mark.parametrize("url", [
    "postmark://token@api.postmarkapp.com",
    "postmark://api.postmarkapp.com",
    "postmark://?api_key=x",
    "postmark://?base_url=http://mail.example.com",  # http only for loopback
    "postmark://?timeout=soon",
    "sendgrid://?base_url=ftp://127.0.0.1",
    "ses://",
    "ses://not a region",
])
def test_bad_urls_are_refused(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigurationError) as info:
        from_url(url, api_key="a:b")
    assert "token@" not in str(info.value)


@pytest.mark.parametrize(("url", "env"), [
    ("postmark://", "POSTMARK_SERVER_TOKEN"),
    ("sendgrid://", "SENDGRID_API_KEY"),
    ("ses://eu-west-1", "AWS_SECRET_ACCESS_KEY"),
])
def test_credentials_come_from_the_environment_or_are_demanded(
    url: str, env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("POSTMARK_SERVER_TOKEN", "SENDGRID_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigurationError) as info:
        from_url(url)
    assert env in str(info.value)
    monkeypatch.setenv("POSTMARK_SERVER_TOKEN", "env-token")
    monkeypatch.setenv("SENDGRID_API_KEY", "env-key")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    provider = from_url(url)
    assert "env-" not in repr(provider) and "<hidden>" in repr(provider)


def test_environment_credentials_reach_the_wire(fake: FakeKeylessProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", fake.aws_credentials.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", fake.aws_credentials.secret_access_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    provider: Provider = from_url("ses://eu-west-1", base_url=fake.url)
    provider.send(receipt(), key=new_key())
    assert fake.delivery_count() == 1


def test_a_forked_process_gets_its_own_connection_pool(
    fake: FakeKeylessProvider, provider: KeylessHTTPProvider
) -> None:
    provider.send(receipt(), key=new_key())
    parent_client = provider._client
    assert parent_client is not None
    held = provider._client_lock
    held.acquire()  # as if a parent thread held the lock at fork(): the child must not wait for it
    try:
        _run_after_fork()  # what a child runs right after fork()
        provider.send(receipt(), key=new_key())
    finally:
        held.release()
    assert provider._client is not parent_client
    assert not parent_client.is_closed  # left alone: its sockets are the parent's
    assert fake.delivery_count() == 2


def test_the_fake_refuses_unknown_faults(fake: FakeKeylessProvider) -> None:
    with pytest.raises(ValueError):
        fake.fail_next("teapot")
