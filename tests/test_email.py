"""The message type: every bad-input class is an InvalidEmail naming its field; good input is stable."""

from __future__ import annotations

from typing import Any

import pytest

from idemmail_celery.email import Attachment, EmailMessage, message_id_for
from idemmail_celery.errors import InvalidEmail


def build(**kw: Any) -> EmailMessage:
    base: dict[str, Any] = {"sender": "Shop <shop@example.com>", "to": "ann@example.com", "subject": "Hi",
                            "text": "hello"}
    base.update(kw)
    return EmailMessage.build(**base)


@pytest.mark.parametrize("kw,field", [
    ({"subject": "Hi\r\nBcc: victim@example.com"}, "subject"),
    ({"to": "ann@example.com\nBcc: x@example.com"}, "to"),
    ({"sender": "shop@example.com\r\n"}, "from"),
    ({"headers": {"X-Tag": "a\nb"}}, "headers[X-Tag]"),
    ({"headers": {"Bad Name": "v"}}, "headers"),
    ({"tags": {"k": "v\r"}}, "tags[k]"),
    ({"to": [], "cc": None, "bcc": None}, "to"),
    ({"to": "not-an-address"}, "to"),
    ({"to": "ann@"}, "to"),
    ({"cc": ["ok@example.com", "bad@@example.com"]}, "cc"),
    ({"sender": ""}, "from"),
    ({"text": None, "html": None}, "text"),
    ({"text": b"bytes"}, "text"),
    ({"subject": 42}, "subject"),
    ({"attachments": [{"filename": "a.txt", "content_b64": "%%%"}]}, "attachments"),
    ({"attachments": [Attachment("a\r\n.txt", b"x")]}, "attachments.filename"),
])
def test_each_bad_input_class_is_an_invalid_email(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        build(**kw)
    assert info.value.field == field


def test_size_limit() -> None:
    with pytest.raises(InvalidEmail, match="over the limit") as info:
        build(html="x" * 2000, max_bytes=1000)
    assert info.value.field == "size"
    with pytest.raises(InvalidEmail, match="over the limit"):
        build(attachments=[Attachment("big.bin", b"\0" * 2000)], max_bytes=1000)


def test_addresses_are_checked_and_normalised() -> None:
    m = build(to=["Ann <ann@Example.COM>", "bob@example.org, cat@example.net"], bcc="hidden@example.com")
    assert m.to == ("Ann <ann@example.com>", "bob@example.org", "cat@example.net")
    assert m.recipients() == ("ann@example.com", "bob@example.org", "cat@example.net", "hidden@example.com")


def test_payload_round_trip_and_deterministic_mime() -> None:
    m = build(html="<p>hi</p>", cc="c@example.com", bcc="b@example.com", headers={"X-Campaign": "nov"},
              attachments=[Attachment("r.pdf", b"%PDF", "application/pdf")])
    again = EmailMessage.from_payload(m.to_payload())
    assert again == m
    one = m.to_mime(message_id=message_id_for("k" * 64, "example.com")).as_bytes()
    two = again.to_mime(message_id=message_id_for("k" * 64, "example.com")).as_bytes()
    assert one == two  # no random boundary, no implicit Date
    assert b"Message-ID: <" + b"k" * 64 + b"@example.com>" in one
    assert b"b@example.com" not in one  # bcc never in the headers
    assert b"Date:" not in one


def test_international_addresses_are_accepted() -> None:
    m = build(sender="Zoë <zoe@exämple.com>", to='"Jürgen, Sales" <jürgen@example.com>')
    assert m.sender == "Zoë <zoe@exämple.com>"
    assert m.to == ('"Jürgen, Sales" <jürgen@example.com>',)
