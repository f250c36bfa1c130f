"""The HTTP provider against the fake Resend-compatible server, over real loopback sockets.

Each test names the behaviour it proves: what the provider sends (key, bearer,
byte-identical bodies), how every answer and transport failure maps onto the
provider contract, and that a retry with the same key after an ambiguous
failure ends in exactly one delivery.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

import idemmail_celery.providers.base as base_module
import idemmail_celery.providers.http as http_module
from idemmail_celery._common import _run_after_fork
from idemmail_celery.email import Attachment, EmailMessage
from idemmail_celery.errors import (
    AmbiguousSendError,
    ConfigurationError,
    PermanentSendError,
    SendError,
    SendNeedsReview,
    TransientSendError,
)
from idemmail_celery.providers import from_url
from idemmail_celery.providers._http import MAX_ERROR_TEXT
from idemmail_celery.providers.http import RESEND_API_URL, HTTPProvider
from idemmail_celery.testing import FakeProvider

SECRET = "re_SECRET_do_not_leak_1234567890"


def new_key() -> str:
    return hashlib.sha256(uuid.uuid4().bytes).hexdigest()


def receipt(text: str = "Thanks for order 4821!", tags: dict[str, str] | None = None) -> EmailMessage:
    return EmailMessage.build(
        sender="Shop <shop@example.com>", to="Ann <ann@example.com>", cc=["bob@example.com"],
        subject="Receipt 4821", text=text, html=f"<p>{text}</p>",
        tags=tags if tags is not None else {"order": "4821", "kind": "receipt"},
        headers={"X-Order": "4821"}, attachments=[Attachment("receipt.txt", b"total: 12.00", "text/plain")],
    )


def wait_for(condition: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(0.01)


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider(api_key=SECRET, slow_seconds=1.0) as server:
        yield server


@pytest.fixture
def provider(fake: FakeProvider) -> Iterator[HTTPProvider]:
    p = HTTPProvider(fake.url, api_key=SECRET, timeout=2.0, connect_timeout=1.0)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _fresh_auth_log(monkeypatch: pytest.MonkeyPatch) -> None:
    # The auth error is logged once per process; each test starts as a new process would.
    monkeypatch.setattr(base_module, "_logged", set())


# -- success and de-duplication --


def test_send_returns_provider_id_and_carries_key_bearer_and_json(fake: FakeProvider, provider: HTTPProvider) -> None:
    key = new_key()
    result = provider.send(receipt(), key=key)

    [delivery] = fake.deliveries()
    assert result.message_id == delivery.message_id
    assert result.provider == "resend"
    assert result.request_id  # the fake's X-Request-Id
    assert delivery.key == key
    assert delivery.recipients == ("Ann <ann@example.com>", "bob@example.com")
    [attempt] = fake.attempts()
    assert attempt.authorized
    assert attempt.headers["idempotency-key"] == key
    assert attempt.headers["authorization"].startswith("Bearer ")
    assert attempt.headers["content-type"] == "application/json"
    assert attempt.headers["user-agent"].startswith("idemmail-celery/")


def test_body_has_resends_shape(fake: FakeProvider, provider: HTTPProvider) -> None:
    provider.send(receipt(), key=new_key())
    body = json.loads(fake.attempts()[0].body)
    assert body["from"] == "Shop <shop@example.com>"
    assert body["to"] == ["Ann <ann@example.com>"]
    assert body["cc"] == ["bob@example.com"]
    assert "bcc" not in body and "reply_to" not in body  # empty fields are left out
    assert body["headers"] == {"X-Order": "4821"}
    assert body["tags"] == [{"name": "kind", "value": "receipt"}, {"name": "order", "value": "4821"}]
    [attachment] = body["attachments"]
    assert attachment["filename"] == "receipt.txt" and attachment["content_type"] == "text/plain"
    assert base64.b64decode(attachment["content"]) == b"total: 12.00"


def test_same_key_twice_is_one_delivery_with_the_same_id(fake: FakeProvider, provider: HTTPProvider) -> None:
    key = new_key()
    first = provider.send(receipt(), key=key)
    second = provider.send(receipt(), key=key)

    assert second.message_id == first.message_id
    assert fake.delivery_count(key) == 1
    assert fake.attempt_count(key) == 2
    assert fake.duplicates_suppressed(key) == 1


def test_a_key_is_forgotten_after_its_window_even_behind_one_kept_longer(
    fake: FakeProvider, provider: HTTPProvider
) -> None:
    kept, short = new_key(), new_key()
    provider.send(receipt(), key=kept)  # remembered for the default day
    fake.dedupe_window = 0.2
    provider.send(receipt(), key=short)
    provider.send(receipt(), key=short)
    assert fake.delivery_count(short) == 1  # inside its window: replayed
    time.sleep(0.3)
    provider.send(receipt(), key=short)
    provider.send(receipt(), key=kept)
    assert (fake.delivery_count(short), fake.delivery_count(kept)) == (2, 1)


def test_two_sends_of_the_same_message_are_byte_identical(fake: FakeProvider, provider: HTTPProvider) -> None:
    key = new_key()
    # Built twice, tags given in another order: equal messages must give equal bytes.
    provider.send(receipt(tags={"order": "4821", "kind": "receipt"}), key=key)
    provider.send(receipt(tags={"kind": "receipt", "order": "4821"}), key=key)

    first, second = fake.attempts()
    assert first.body == second.body
    assert second.outcome == "replayed"  # the fake compares bodies byte for byte: no mismatch


def test_same_key_with_another_payload_needs_review(fake: FakeProvider, provider: HTTPProvider) -> None:
    key = new_key()
    provider.send(receipt(), key=key)
    with pytest.raises(SendNeedsReview) as info:
        provider.send(receipt(text="Rewritten body"), key=key)
    assert info.value.reason == "key_payload_mismatch"
    assert info.value.key == key
    assert fake.delivery_count() == 1


# -- answers that send nothing --


@pytest.mark.parametrize(
    ("fault", "error", "reason", "retry_after"),
    [
        ("422", PermanentSendError, "rejected", None),
        ("401", TransientSendError, "auth", None),
        ("429", TransientSendError, "rate_limited", 1.0),
        ("409_processing", AmbiguousSendError, "provider_in_flight", 1.0),
    ],
)
def test_refusals_map_to_their_outcome_and_deliver_nothing(
    fake: FakeProvider, provider: HTTPProvider, fault: str, error: type[SendError], reason: str,
    retry_after: float | None,
) -> None:
    key = new_key()
    fake.fail_next(fault)
    with pytest.raises(SendError) as info:
        provider.send(receipt(), key=key)

    assert type(info.value) is error
    assert info.value.reason == reason
    assert info.value.key == key
    if isinstance(info.value, TransientSendError):
        assert info.value.retry_after == retry_after
    assert fake.delivery_count() == 0
    # Nothing was accepted, so the retry is simply the first delivery.
    assert provider.send(receipt(), key=key).message_id == fake.deliveries()[0].message_id
    assert fake.delivery_count(key) == 1


def test_rejection_carries_the_providers_message(fake: FakeProvider, provider: HTTPProvider) -> None:
    fake.fail_next("422")
    with pytest.raises(PermanentSendError, match="the message was rejected"):
        provider.send(receipt(), key=new_key())


def test_other_4xx_is_permanent(fake: FakeProvider) -> None:
    wrong_path = HTTPProvider(f"{fake.url}/v1/nowhere", api_key=SECRET)
    with pytest.raises(PermanentSendError) as info:
        wrong_path.send(receipt(), key=new_key())
    assert info.value.reason == "http_404"
    wrong_path.close()


def test_wrong_api_key_is_transient_auth_and_logged_once(
    fake: FakeProvider, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger=http_module.__name__)
    wrong = HTTPProvider(fake.url, api_key="re_wrong_key")
    for _ in range(2):
        with pytest.raises(TransientSendError) as info:
            wrong.send(receipt(), key=new_key())
        assert info.value.reason == "auth"
    wrong.close()

    assert fake.delivery_count() == 0
    lines = [r for r in caplog.records if "provider rejected the API key" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    assert "re_wrong_key" not in caplog.text


# -- ambiguous outcomes, and the retry with the same key --


@pytest.mark.parametrize(
    ("fault", "reason", "delivered"),
    [("500_after_accept", "http_500", 1), ("503_before_accept", "http_503", 0)],
)
def test_5xx_is_ambiguous_and_the_retry_delivers_once(
    fake: FakeProvider, provider: HTTPProvider, fault: str, reason: str, delivered: int
) -> None:
    key = new_key()
    fake.fail_next(fault)
    with pytest.raises(AmbiguousSendError) as info:
        provider.send(receipt(), key=key)
    assert info.value.reason == reason
    assert fake.delivery_count(key) == delivered

    result = provider.send(receipt(), key=key)
    assert fake.delivery_count(key) == 1
    assert result.message_id == fake.deliveries()[0].message_id


def test_connection_dropped_after_accept_is_ambiguous_and_the_retry_delivers_once(
    fake: FakeProvider, provider: HTTPProvider
) -> None:
    key = new_key()
    fake.fail_next("drop_after_accept")
    with pytest.raises(AmbiguousSendError) as info:
        provider.send(receipt(), key=key)
    assert info.value.reason == "connection_dropped"
    assert fake.delivery_count(key) == 1  # it did go out

    result = provider.send(receipt(), key=key)
    assert fake.delivery_count(key) == 1
    assert fake.duplicates_suppressed(key) == 1
    assert result.message_id == fake.deliveries()[0].message_id


def test_read_timeout_is_ambiguous_in_flight_then_one_delivery(fake: FakeProvider) -> None:
    impatient = HTTPProvider(fake.url, api_key=SECRET, timeout=0.3)
    key = new_key()
    fake.fail_next("slow")  # the fake holds the request for 1 s
    with pytest.raises(AmbiguousSendError) as info:
        impatient.send(receipt(), key=key)
    assert info.value.reason == "timeout"

    # The first request is still being processed: the provider says so, and nothing is sent twice.
    with pytest.raises(AmbiguousSendError) as busy:
        impatient.send(receipt(), key=key)
    assert busy.value.reason == "provider_in_flight"
    assert busy.value.retry_after == 1.0

    wait_for(lambda: fake.delivery_count(key) == 1)
    result = impatient.send(receipt(), key=key)
    assert result.message_id == fake.deliveries()[0].message_id
    assert fake.delivery_count(key) == 1
    impatient.close()


def test_connect_refused_is_transient(provider: HTTPProvider) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Nothing listens on the port any more: the connection is refused before a byte is written.
    closed = HTTPProvider(f"http://127.0.0.1:{port}", api_key=SECRET, connect_timeout=1.0)
    with pytest.raises(TransientSendError) as info:
        closed.send(receipt(), key=new_key())
    assert info.value.reason == "connect"


def test_a_stopped_provider_refuses_and_a_restarted_one_serves_the_same_url(fake: FakeProvider) -> None:
    provider = HTTPProvider(fake.url, api_key=SECRET, connect_timeout=1.0)
    provider.send(receipt(), key=new_key())  # leaves a keep-alive connection in the pool
    fake.stop()
    with pytest.raises((TransientSendError, AmbiguousSendError)):
        # Refused (new connection) or dropped (the pooled one was cut): never a success.
        provider.send(receipt(), key=new_key())
    fake.start()
    key = new_key()
    assert provider.send(receipt(), key=key).message_id == fake.deliveries()[-1].message_id
    provider.close()


# -- configuration and secrets --


@pytest.mark.parametrize(
    "url",
    [f"https://{SECRET}@api.example.com/emails", f"https://user:{SECRET}@api.example.com", f"resend://{SECRET}@"],
)
def test_api_key_in_the_url_is_refused_without_repeating_it(url: str) -> None:
    with pytest.raises(ConfigurationError, match="idemmail_provider_api_key, not the URL") as info:
        HTTPProvider(url, api_key="re_other")
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("url", ["http://api.example.com/emails", "ftp://127.0.0.1/", "https:///emails"])
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        HTTPProvider(url, api_key=SECRET)


def test_no_api_key_anywhere_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IDEMMAIL_PROVIDER_API_KEY", raising=False)
    monkeypatch.delenv("RESEND_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="API key"):
        HTTPProvider("resend://")


def test_api_key_from_the_environment_in_order(fake: FakeProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMMAIL_PROVIDER_API_KEY", SECRET)
    monkeypatch.setenv("RESEND_API_KEY", "re_wrong_key")
    provider = HTTPProvider(fake.url)
    provider.send(receipt(), key=new_key())
    assert fake.delivery_count() == 1
    provider.close()


def test_api_key_never_appears_in_repr_or_any_raised_error(fake: FakeProvider, provider: HTTPProvider) -> None:
    assert SECRET not in repr(provider) and SECRET not in str(provider)
    errors: list[BaseException] = []
    for fault in ("422", "401", "429", "409_processing", "503_before_accept", "500_after_accept", "drop_after_accept"):
        fake.fail_next(fault)
        with pytest.raises(SendError) as info:
            provider.send(receipt(), key=new_key())
        errors.append(info.value)
    for error in errors:
        assert SECRET not in str(error) and SECRET not in repr(error)
        assert error.__cause__ is None  # an httpx error would carry the request and its Authorization header


def test_a_provider_echoing_the_authorization_header_does_not_leak_the_key() -> None:
    class Echo(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"name": "validation_error", "message": f"bad: {self.headers['Authorization']}"})
            self.send_response(422)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data.encode())

        def log_message(self, format: str, *args: object) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        provider = HTTPProvider(f"http://127.0.0.1:{server.server_address[1]}", api_key=SECRET)
        with pytest.raises(PermanentSendError) as info:
            provider.send(receipt(), key=new_key())
        assert "Bearer <api key>" in str(info.value)
        assert SECRET not in str(info.value) and SECRET not in repr(info.value)
        provider.close()
    finally:
        server.shutdown()
        server.server_close()


# A subject with two spaces and a TAB: a provider quoting it, and the provider's own one-line error text,
# put other white space between its words than the message has.
ODD_SUBJECT = "Your  test\tresults are ready, Ann"


@pytest.mark.parametrize("quoted", [
    ODD_SUBJECT,  # as sent: the error text's white space is collapsed before it is shown
    " ".join(ODD_SUBJECT.split()),  # the provider collapsed it itself
    "p" * (MAX_ERROR_TEXT - 21) + " " + ODD_SUBJECT,  # across the cut to MAX_ERROR_TEXT
], ids=["as-sent", "collapsed", "at-the-cut"])
def test_a_refusal_quoting_the_subject_with_other_white_space_shows_none_of_it(quoted: str) -> None:
    class Quoting(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"name": "validation_error", "message": f"subject {quoted} is not allowed"}).encode()
            self.send_response(422)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            return None

    message = EmailMessage.build(sender="shop@example.com", to="ann@example.com", subject=ODD_SUBJECT, text="x")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Quoting)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        provider = HTTPProvider(f"http://127.0.0.1:{server.server_address[1]}", api_key=SECRET, timeout=2.0)
        with pytest.raises(PermanentSendError) as info:
            provider.send(message, key=new_key())
        provider.close()
    finally:
        server.shutdown()
        server.server_close()
    shown = f"{info.value} {info.value.args!r}"
    assert "<redacted>" in shown
    for word in ("test", "results", "ready"):
        assert word not in shown, shown
    assert "Your tes" not in shown and "Your  tes" not in shown


def test_a_forked_process_gets_its_own_connection_pool(fake: FakeProvider, provider: HTTPProvider) -> None:
    provider.send(receipt(), key=new_key())
    parent_client = provider._client
    assert parent_client is not None
    _run_after_fork()  # what a child runs right after fork()
    provider.send(receipt(), key=new_key())

    assert provider._client is not parent_client
    assert not parent_client.is_closed  # left alone: its sockets are the parent's
    assert fake.delivery_count() == 2
    provider.close()
    parent_client.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_real_forked_child_sends_on_its_own_connection(fake: FakeProvider, provider: HTTPProvider) -> None:
    provider.send(receipt(), key=new_key())  # the parent's pool holds a live connection now
    child_key = new_key()
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            code = 0 if provider.send(receipt(), key=child_key).message_id else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10.0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child did not finish its send")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fake.delivery_count(child_key) == 1
    provider.send(receipt(), key=new_key())  # the parent's connection was not disturbed
    assert fake.delivery_count() == 3


def test_from_url_builds_the_http_provider() -> None:
    resend = from_url("resend://", api_key=SECRET)
    assert isinstance(resend, HTTPProvider) and resend.url == RESEND_API_URL
    assert resend.accepts_idempotency_key
    https = from_url("https://mail.example.com:8443", api_key=SECRET, timeout=3.0)
    assert isinstance(https, HTTPProvider) and https.url == "https://mail.example.com:8443/emails"
    custom = from_url("https://mail.example.com/v2/send?x=1", api_key=SECRET)
    assert isinstance(custom, HTTPProvider) and custom.url == "https://mail.example.com/v2/send?x=1"
    loopback = from_url("http://[::1]:9/", api_key=SECRET)
    assert isinstance(loopback, HTTPProvider) and loopback.url == "http://[::1]:9/emails"


# -- the fake's own surface that other processes and plugins use --


def test_fake_answers_stats_and_queues_faults_for_other_processes(fake: FakeProvider, provider: HTTPProvider) -> None:
    key = new_key()
    queued = httpx.post(f"{fake.url}/_fake/faults", json={"kind": "500_after_accept", "times": 1})
    assert queued.json()["pending_faults"] == ["500_after_accept"]
    with pytest.raises(AmbiguousSendError):
        provider.send(receipt(), key=key)
    provider.send(receipt(), key=key)

    stats = httpx.get(f"{fake.url}/_fake/stats").json()
    assert stats["deliveries"] == 1 and stats["attempts"] == 2 and stats["suppressed"] == 1
    assert stats["per_key"][key] == {"deliveries": 1, "attempts": 2, "suppressed": 1}
    assert httpx.post(f"{fake.url}/_fake/faults", json={"kind": "nonsense"}).status_code == 400


def test_fake_without_dedupe_plays_a_provider_that_ignores_keys() -> None:
    with FakeProvider(api_key=SECRET, dedupe=False) as keyless:
        p = HTTPProvider(keyless.url, api_key=SECRET)
        key = new_key()
        assert p.send(receipt(), key=key).message_id != p.send(receipt(), key=key).message_id
        assert keyless.delivery_count(key) == 2
        p.close()


def test_fixture_from_the_plugin_starts_a_fake(fake_provider: FakeProvider) -> None:
    p = HTTPProvider(fake_provider.url, api_key=fake_provider.api_key)
    p.send(receipt(), key=new_key())
    assert fake_provider.delivery_count() == 1
    fake_provider.reset()
    assert fake_provider.delivery_count() == 0 and fake_provider.attempts() == []
    p.close()
