"""Header injection through RFC 2047 encoded words, end to end.

``send_email`` refuses an encoded word at ``delay()`` and again in the worker (a message
published by name skips ``delay()``), and sends nothing; what a real SMTP server receives
carries the message's own headers and no other line, and a message made without validation
cannot reach the server with an extra header either. A real app on a SQLite ledger and the
file provider (one ``.eml`` per delivered email), and a real SMTP server (``SMTPSink``).
"""

from __future__ import annotations

import email
import email.policy
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from idemmail_celery.email import EmailMessage
from idemmail_celery.errors import InvalidEmail, PermanentSendError
from idemmail_celery.mail import register
from idemmail_celery.providers import from_url
from idemmail_celery.testing.smtp_sink import SMTPSink

from .conftest import unique

INJECTION = "=?utf-8?q?x=0D=0ABcc=3A_eve=40evil.example?="


@pytest.fixture
def app(tmp_path: Path) -> Celery:
    a = Celery(unique("ew"), broker="memory://", set_as_current=False)
    a.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", idemmail_key_secret="s",
                  idemmail_provider_url=f"file://{tmp_path / 'out'}", idemmail_default_from="Shop <shop@example.com>")
    register(a)
    return a


def delivered(tmp_path: Path) -> list[Path]:
    out = tmp_path / "out"
    return sorted(out.iterdir()) if out.exists() else []


@pytest.mark.parametrize("kw,field", [
    ({"subject": f"Your order {INJECTION}"}, "subject"),
    ({"to": f"{INJECTION} <ann@example.com>"}, "to"),
    ({"from_": f"{INJECTION} <shop@example.com>"}, "from"),
    ({"headers": {"X-Campaign": INJECTION}}, "headers[X-Campaign]"),
])
def test_send_email_refuses_an_encoded_word_at_delay_and_the_worker_sends_nothing(
        app: Celery, tmp_path: Path, kw: dict[str, Any], field: str) -> None:
    task = app.tasks["idemmail_celery.send_email"]
    call: dict[str, Any] = {"to": "ann@example.com", "subject": "Your order", "text": "It has shipped.",
                            "event_id": "o-1", **kw}
    with pytest.raises(InvalidEmail) as info:
        task.delay(**call)
    assert info.value.field == field
    outcome = task.apply(kwargs=call)  # the worker, as for a message published by name: no delay() in front
    assert isinstance(outcome.result, PermanentSendError) and outcome.result.reason == "invalid_email"
    assert str(outcome.result).startswith(f"{field} contains") and "encoded word" in str(outcome.result)
    assert delivered(tmp_path) == []


def test_a_message_that_only_resembles_an_encoded_word_is_delivered_as_written(app: Celery, tmp_path: Path) -> None:
    task = app.tasks["idemmail_celery.send_email"]
    subject = "Quiz: 2+2=? Grüße aus Köln"
    task.apply(kwargs={"to": "Zoë <zoe@example.com>", "subject": subject, "text": "hi", "event_id": "q-1"}).get()
    [eml] = delivered(tmp_path)
    parsed = email.message_from_bytes(eml.read_bytes(), policy=email.policy.default)
    assert parsed["Subject"] == subject and str(parsed["To"]) == "Zoë <zoe@example.com>"
    assert parsed["Bcc"] is None


def header_names(raw: bytes) -> list[str]:
    head = raw.replace(b"\r\n", b"\n").split(b"\n\n", 1)[0]
    return [line.split(b":", 1)[0].decode() for line in head.split(b"\n") if line[:1] not in (b" ", b"\t")]


def test_what_an_smtp_server_receives_has_the_messages_headers_and_no_other_line() -> None:
    ok = EmailMessage.build(sender="Shop <shop@example.com>", to="Zoë Doe <zoe@example.com>",
                            subject="2+2=? " + "Grüße " * 20, text="hi", headers={"X-Note": "a=?b"})
    # Made without build() (its fields are trusted): to_mime is the last line before the wire.
    forged = EmailMessage(sender="Shop <shop@example.com>", to=("ann@example.com",),
                          subject=f"Hi {INJECTION}", text="hi")
    with SMTPSink() as sink:
        provider = from_url(sink.url, timeout=2)
        provider.send(ok, key="k" * 64)
        with pytest.raises(InvalidEmail) as info:
            provider.send(forged, key="f" * 64)
        assert info.value.field == "subject"
        [received] = sink.messages()
    assert header_names(received.raw) == ["From", "To", "Subject", "Message-ID", "Date", "X-Note",
                                          "Content-Type", "Content-Transfer-Encoding", "MIME-Version"]
    assert received.rcpt_tos == ("zoe@example.com",)
