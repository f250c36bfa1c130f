"""SMTPProvider against a real SMTP server (SMTPSink) over real loopback sockets.

Every row of the provider's error-mapping table is driven by a fault the server
really commits; the crash-after-DATA case is proven to be ambiguous by showing the
server did keep the message the client was never told about.
"""

from __future__ import annotations

import contextlib
import email
import email.policy
import hashlib
import inspect
import logging
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.exceptions import SoftTimeLimitExceeded

import idemmail_celery.providers.base as base_module
from idemmail_celery.email import EmailMessage
from idemmail_celery.errors import AmbiguousSendError, ConfigurationError, PermanentSendError, TransientSendError
from idemmail_celery.providers import from_url
from idemmail_celery.providers.smtp import PASSWORD_ENV, SMTPProvider
from idemmail_celery.testing.smtp_sink import SMTPSink

from .conftest import require_program

PASSWORD = "correct-horse-battery-staple-7f3a"


def key_for(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def make_message(**overrides: object) -> EmailMessage:
    fields: dict[str, object] = {
        "sender": "Shop <shop@example.com>", "to": "Ann <ann@example.com>", "subject": "Your receipt",
        "text": "Thanks for order 4821.\n", "bcc": "audit@example.org",
    }
    fields.update(overrides)
    return EmailMessage.build(**fields)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_password_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)


@pytest.fixture
def sink() -> Iterator[SMTPSink]:
    with SMTPSink() as server:
        yield server


@pytest.fixture
def provider(sink: SMTPSink) -> SMTPProvider:
    built = from_url(sink.url, timeout=2)
    assert isinstance(built, SMTPProvider)
    return built


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- success --


def test_send_delivers_once_with_message_id_from_key_and_bcc_only_in_envelope(
        sink: SMTPSink, provider: SMTPProvider) -> None:
    key = key_for("success")
    result = provider.send(make_message(cc="Bob <bob@example.net>"), key=key)

    assert result.message_id == f"<{key}@example.com>"
    assert result.provider == "smtp"
    assert result.extra["smtp_reply"].startswith("250 ")
    assert "refused" not in result.extra
    assert sink.count(result.message_id) == 1
    received = sink.messages()[0]
    assert received.mail_from == "shop@example.com"
    assert set(received.rcpt_tos) == {"ann@example.com", "bob@example.net", "audit@example.org"}
    headers = email.message_from_bytes(received.raw, policy=email.policy.default)
    assert headers["Message-ID"] == result.message_id
    assert headers["Date"]  # SMTP needs one; set at send time
    assert headers["Bcc"] is None
    assert b"audit@example.org" not in received.raw


def test_domain_option_names_the_message_id_domain(sink: SMTPSink) -> None:
    key = key_for("domain")
    result = from_url(f"{sink.url}?domain=mail.example.org&timeout=2").send(make_message(), key=key)
    assert result.message_id == f"<{key}@mail.example.org>"
    assert sink.count(result.message_id) == 1


def test_lines_starting_with_a_dot_arrive_intact(sink: SMTPSink, provider: SMTPProvider) -> None:
    text = "first\n.\n..two dots\n.final\n"
    provider.send(make_message(text=text), key=key_for("dots"))
    body = email.message_from_bytes(sink.messages()[0].raw, policy=email.policy.default)
    assert body.get_content().replace("\r\n", "\n") == text


def test_non_ascii_body_is_sent_as_8bitmime(sink: SMTPSink, provider: SMTPProvider) -> None:
    provider.send(make_message(subject="Grüße", text="Danke schön, Zoë.\n"), key=key_for("utf8"))
    parsed = email.message_from_bytes(sink.messages()[0].raw, policy=email.policy.default)
    assert parsed["Subject"] == "Grüße"
    assert "Danke schön, Zoë." in parsed.get_content()


def test_from_url_builds_smtp_and_smtps_with_default_ports_without_connecting() -> None:
    plain = from_url("smtp://relay.example.com")
    implicit = from_url("smtps://relay.example.com")
    assert isinstance(plain, SMTPProvider) and isinstance(implicit, SMTPProvider)
    assert (plain.port, plain.implicit_tls) == (25, False)
    assert (implicit.port, implicit.implicit_tls) == (465, True)
    assert plain.accepts_idempotency_key is False
    assert from_url("smtp://relay.example.com:2525?starttls=1&timeout=5").port == 2525  # type: ignore[attr-defined]


# -- the crash-after-DATA window --


def test_drop_after_data_is_ambiguous_and_the_server_did_record_one_delivery(
        sink: SMTPSink, provider: SMTPProvider) -> None:
    key = key_for("drop")
    sink.fail_next("drop_after_data")
    with pytest.raises(AmbiguousSendError) as caught:
        provider.send(make_message(), key=key)
    assert caught.value.reason == "after_data"
    assert caught.value.key == key
    # The server kept the message the client was never told about: resending blindly would duplicate it.
    assert sink.count(f"<{key}@example.com>") == 1
    assert sink.messages()[0].acknowledged is False


def test_no_reply_after_data_within_the_timeout_is_ambiguous(sink: SMTPSink) -> None:
    key = key_for("stall")
    sink.fail_next("stall_after_data")
    started = time.monotonic()
    with pytest.raises(AmbiguousSendError) as caught:
        from_url(sink.url, timeout=0.5).send(make_message(), key=key)
    assert caught.value.reason == "after_data"
    assert time.monotonic() - started < 5
    assert sink.count(f"<{key}@example.com>") == 1


@contextlib.contextmanager
def soft_time_limit_in(seconds: float) -> Iterator[None]:
    """Raise Celery's SoftTimeLimitExceeded in this (the main) thread after ``seconds``, as a prefork
    worker's soft time limit does (SIGUSR1 to the pool child)."""
    def expire(signum: int, frame: object) -> None:
        raise SoftTimeLimitExceeded()

    previous = signal.signal(signal.SIGUSR1, expire)
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGUSR1))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize(("fault", "stored", "reason", "stage"), [
    ("stall_rcpt", 0, "interrupted", "at RCPT TO"),
    ("stall_after_data", 1, "after_data", "after the message was written"),
])
def test_a_send_interrupted_mid_conversation_says_the_stage_and_only_after_data_is_parked(
        sink: SMTPSink, fault: str, stored: int, reason: str, stage: str, tmp_path: Path) -> None:
    """Two sends cut off by a soft time limit while the server hangs: at RCPT (it holds nothing) the
    record is released for a retry; after the message was written it is parked, and the review record
    (what ``ledger show`` prints) names the stage. Before, both were parked alike ("unexpected_error")."""
    from idemmail_celery.handler import Delivery, Handler, Outcome, Policy
    from idemmail_celery.keys import IntentKeyBuilder, Payload
    from idemmail_celery.ledger import State
    from idemmail_celery.ledger import from_url as ledger_from_url

    provider = from_url(sink.url, timeout=30)  # the limit comes first, as when a worker's limit is shorter

    class Smtp:
        def check(self, payload: Payload) -> None: ...
        def perform(self, payload: Payload, key: str) -> object:
            with soft_time_limit_in(0.5):
                return provider.send(make_message(), key=key).to_dict()
        def carries_key(self) -> bool:
            return False
        def reconcile(self, key: str, payload: Payload) -> object:
            return None
        def report(self, outcome: Outcome, key: str, **fields: object) -> None: ...

    ledger = ledger_from_url(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    builder = IntentKeyBuilder(task_name="tests.smtp", signature=inspect.signature(lambda to: None))
    handler = Handler(ledger, builder, Policy(lease_seconds=30.0), Smtp())
    key = key_for(fault)
    sink.fail_next(fault)  # type: ignore[arg-type]
    step = handler.handle(Delivery(key=key, task_name="tests.smtp", payload=Payload([], {"to": "a@example.com"}),
                                   attempt_id="t-1", max_retries=3))
    assert sink.count(f"<{key}@example.com>") == stored
    record = ledger.get(key)
    assert record is not None and record.error is not None
    assert record.error["reason"] == reason and stage in record.error["message"]
    assert "SoftTimeLimitExceeded" in record.error["message"]
    if stored:
        assert step.outcome is Outcome.REVIEW and record.state is State.REVIEW
    else:
        assert step.outcome is Outcome.RETRY and record.state is State.RELEASED
    ledger.close()


# -- refusals before DATA: nothing was sent --


@pytest.mark.parametrize(("fault", "error", "reason"), [
    ("tempfail_mail", TransientSendError, "tempfail"),
    ("reject_mail", PermanentSendError, "rejected"),
    ("tempfail_rcpt", TransientSendError, "tempfail"),
    ("tempfail_data_command", TransientSendError, "tempfail"),
    ("reject_data_command", PermanentSendError, "rejected"),
])
def test_refusal_before_the_message_is_written_maps_and_sends_nothing(
        sink: SMTPSink, provider: SMTPProvider, fault: str, error: type[Exception], reason: str) -> None:
    key = key_for(fault)
    sink.fail_next(fault)  # type: ignore[arg-type]
    with pytest.raises(error) as caught:
        provider.send(make_message(bcc=None), key=key)
    assert caught.value.reason == reason  # type: ignore[attr-defined]
    assert caught.value.key == key  # type: ignore[attr-defined]
    assert sink.count() == 0
    assert provider.send(make_message(bcc=None), key=key).message_id == f"<{key}@example.com>"  # fault consumed
    assert sink.count() == 1


def test_every_recipient_refused_is_permanent(sink: SMTPSink, provider: SMTPProvider) -> None:
    sink.fail_next("reject_rcpt", times=2)
    with pytest.raises(PermanentSendError) as caught:
        provider.send(make_message(), key=key_for("all-refused"))
    assert caught.value.reason == "rejected"
    assert "every recipient (2) was refused: #1: 550" in str(caught.value) and "#2: 550" in str(caught.value)
    assert "@" not in str(caught.value)  # the message reaches logs, Flower and the ledger: no address
    assert sink.count() == 0


def test_some_recipients_refused_sends_to_the_others_and_lists_the_refused(
        sink: SMTPSink, provider: SMTPProvider) -> None:
    sink.fail_next("reject_rcpt")  # the first RCPT: ann; audit (bcc) is accepted
    result = provider.send(make_message(), key=key_for("partial"))
    assert result.extra["refused"] == [{"index": 1, "code": 550, "reply": "5.1.1 No such user (injected)"}]
    assert sink.messages()[0].rcpt_tos == ("audit@example.org",)


def test_one_recipient_deferred_fails_the_whole_send_before_data(sink: SMTPSink, provider: SMTPProvider) -> None:
    sink.fail_next("reject_rcpt")
    sink.fail_next("tempfail_rcpt")  # ann refused for good, audit deferred: retry later, to everyone
    with pytest.raises(TransientSendError) as caught:
        provider.send(make_message(), key=key_for("mixed"))
    assert caught.value.reason == "tempfail"
    assert sink.count() == 0


# -- final reply after the message --


@pytest.mark.parametrize(("fault", "error", "reason"), [
    ("tempfail_data", TransientSendError, "tempfail"),
    ("reject_data", PermanentSendError, "rejected"),
])
def test_final_reply_after_the_message_maps_4xx_transient_and_5xx_permanent(
        sink: SMTPSink, provider: SMTPProvider, fault: str, error: type[Exception], reason: str) -> None:
    sink.fail_next(fault)  # type: ignore[arg-type]
    with pytest.raises(error) as caught:
        provider.send(make_message(), key=key_for(fault))
    assert caught.value.reason == reason  # type: ignore[attr-defined]
    assert sink.count() == 0


# -- connecting --


def test_connection_refused_is_transient_connect() -> None:
    with pytest.raises(TransientSendError) as caught:
        from_url(f"smtp://127.0.0.1:{closed_port()}", timeout=2).send(make_message(), key=key_for("refused"))
    assert caught.value.reason == "connect"


def test_server_that_never_greets_times_out_as_transient_connect() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)  # the kernel completes the handshake; nobody ever says 220
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(TransientSendError) as caught:
            from_url(f"smtp://127.0.0.1:{port}", timeout=0.3).send(make_message(), key=key_for("silent"))
    assert caught.value.reason == "connect"
    assert time.monotonic() - started < 5


def test_tls_handshake_failure_is_transient_connect(sink: SMTPSink) -> None:
    # smtps:// to a plain-text server: the TLS handshake reads "220 ..." and fails.
    with pytest.raises(TransientSendError) as caught:
        from_url(f"smtps://127.0.0.1:{sink.port}", timeout=2).send(make_message(), key=key_for("tls"))
    assert caught.value.reason == "connect"
    assert sink.count() == 0


def test_starttls_required_but_not_offered_is_transient_connect(sink: SMTPSink) -> None:
    with pytest.raises(TransientSendError) as caught:
        from_url(f"{sink.url}?starttls=1", timeout=2).send(make_message(), key=key_for("no-starttls"))
    assert caught.value.reason == "connect"
    assert "STARTTLS" in str(caught.value)
    assert sink.count() == 0


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    openssl = require_program("openssl")  # to make a test certificate
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


def server_context(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    return context


def test_smtps_and_starttls_deliver_when_the_certificate_is_trusted(certificate: tuple[Path, Path]) -> None:
    trusting = ssl.create_default_context(cafile=str(certificate[0]))
    with SMTPSink(ssl_context=server_context(certificate), implicit_tls=True) as implicit:
        assert implicit.url.startswith("smtps://")
        from_url(implicit.url, timeout=2, ssl_context=trusting).send(make_message(), key=key_for("smtps"))
        assert implicit.count() == 1
    with SMTPSink(ssl_context=server_context(certificate)) as starttls:
        from_url(f"{starttls.url}?starttls=1", timeout=2, ssl_context=trusting).send(make_message(), key=key_for("st"))
        assert starttls.count() == 1


def test_untrusted_certificate_is_transient_connect(certificate: tuple[Path, Path]) -> None:
    with SMTPSink(ssl_context=server_context(certificate), implicit_tls=True) as implicit:
        with pytest.raises(TransientSendError) as caught:
            from_url(implicit.url, timeout=2).send(make_message(), key=key_for("untrusted"))
        assert caught.value.reason == "connect"
        assert implicit.count() == 0


# -- credentials --


def test_login_with_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    with SMTPSink(credentials=("ann", PASSWORD)) as server:
        provider = from_url(f"smtp://ann@127.0.0.1:{server.port}", timeout=2)
        provider.send(make_message(), key=key_for("auth-ok"))
        assert server.messages()[0].login == "ann"
        assert PASSWORD not in repr(provider)


def test_auth_failure_is_transient_logged_once_and_never_shows_the_password(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(base_module, "_logged", set())
    caplog.set_level(logging.DEBUG)
    with SMTPSink(credentials=("ann", "the-real-one")) as server:
        provider = from_url(f"smtp://ann@127.0.0.1:{server.port}", password=PASSWORD, timeout=2)
        errors = []
        for n in range(2):
            with pytest.raises(TransientSendError) as caught:
                provider.send(make_message(), key=key_for(f"auth-bad-{n}"))
            errors.append(caught.value)
        assert server.count() == 0
    assert [e.reason for e in errors] == ["auth", "auth"]
    for error in errors:
        assert PASSWORD not in str(error) and PASSWORD not in repr(error.args)
    auth_errors = [r for r in caplog.records if r.levelno == logging.ERROR and "authentication" in r.getMessage()]
    assert len(auth_errors) == 1
    assert PASSWORD not in caplog.text
    assert PASSWORD not in repr(provider)


def test_password_inside_the_url_is_refused_without_echoing_it() -> None:
    for url in (f"smtp://ann:{PASSWORD}@relay.example.com", f"smtps://relay.example.com?password={PASSWORD}"):
        with pytest.raises(ConfigurationError) as caught:
            from_url(url)
        assert PASSWORD not in str(caught.value)


@pytest.mark.parametrize(("url", "options"), [
    ("smtp://ann@relay.example.com:587?starttls=1", {}),  # a user but no password anywhere
    ("smtp://relay.example.com", {"password": PASSWORD}),  # a password but no user
    ("smtp://ann@relay.example.com", {"password": PASSWORD}),  # credentials in clear over the network
    ("smtps://relay.example.com?starttls=1", {}),
    ("smtp://relay.example.com?tls=1", {}),
    ("smtp://relay.example.com?timeout=soon", {}),
    ("smtp://", {}),
])
def test_bad_configuration_fails_at_construction(url: str, options: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError) as caught:
        from_url(url, **options)
    assert PASSWORD not in str(caught.value)


def test_repr_names_the_server_but_not_the_password() -> None:
    provider = from_url("smtps://ann@relay.example.com", api_key=PASSWORD)
    assert "relay.example.com" in repr(provider) and "ann@" in repr(provider)
    assert PASSWORD not in repr(provider)


@pytest.mark.parametrize("fault", ["reject_rcpt", "tempfail_rcpt", "reject_mail"])
def test_a_refusal_naming_the_address_leaves_no_address_in_the_error_or_the_result(
        sink: SMTPSink, provider: SMTPProvider, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, fault: str) -> None:
    from idemmail_celery.testing import smtp_sink

    # Real servers name the address in their reply: "550 5.1.1 <ann@example.com>: Recipient address rejected".
    table = smtp_sink._MAIL_FAULTS if fault == "reject_mail" else smtp_sink._RCPT_FAULTS
    code = table[fault].split(" ", 1)[0]
    monkeypatch.setitem(table, fault, f"{code} 5.1.1 <ann@example.com>: Recipient address rejected (injected)")
    sink.fail_next(fault, times=1 if fault == "reject_mail" else 2)  # type: ignore[arg-type]
    with pytest.raises((PermanentSendError, TransientSendError)) as caught:
        provider.send(make_message(), key=key_for(f"named-{fault}"))
    text = str(caught.value)
    assert "<address>: Recipient address rejected" in text
    assert "@" not in text and "shop@" not in text

    sink.fail_next("reject_rcpt")  # partial: ann refused, audit accepted; the result is stored and replayed
    monkeypatch.setitem(smtp_sink._RCPT_FAULTS, "reject_rcpt",
                        "550 5.1.1 <ann@example.com>: Recipient address rejected (injected)")
    result = provider.send(make_message(), key=key_for(f"partial-named-{fault}"))
    assert result.extra["refused"] == [
        {"index": 1, "code": 550, "reply": "5.1.1 <address>: Recipient address rejected (injected)"}]
    assert "@" not in repr(result.extra)
    assert not [r for r in caplog.records if "ann@example.com" in r.getMessage()]
