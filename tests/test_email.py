"""The message type: every bad-input class is an InvalidEmail naming its field; good input is stable."""

from __future__ import annotations

import base64
import email
import email.policy
import sys
from typing import Any

import pytest

from idemmail_celery.email import (
    DEFAULT_MAX_RECIPIENTS,
    Attachment,
    EmailMessage,
    format_address,
    message_id_for,
    parse_address,
    split_address,
)
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
    m = build(to=["Ann <ann@Example.COM>", "bob@example.org", "cat@example.net"], bcc="hidden@example.com")
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


@pytest.mark.parametrize("parts", [{"text": "hi", "html": "<p>hi</p>"}, {"html": "<p>hi</p>"},
                                   {"text": "hi", "attachments": [Attachment("r.pdf", b"%PDF", "application/pdf")]},
                                   {"text": "hi", "html": "<p>hi</p>",
                                    "attachments": [Attachment("r.pdf", b"%PDF", "application/pdf")]}])
def test_mime_version_is_on_the_message_only_never_on_a_part(parts: dict[str, Any]) -> None:
    sent = build(**{"text": None, **parts}).to_mime().as_bytes()
    assert sent.count(b"MIME-Version:") == 1
    parsed = email.message_from_bytes(sent, policy=email.policy.SMTP)
    assert parsed["MIME-Version"] == "1.0"
    inner = [part for part in parsed.walk() if part is not parsed]
    assert all("MIME-Version" not in part for part in inner)
    kinds = [part.get_content_type() for part in parsed.walk()]
    assert ("text/html" in kinds) == ("html" in parts) and ("text/plain" in kinds) == ("text" in parts)


def test_international_addresses_are_accepted() -> None:
    m = build(sender="Zoë <zoe@exämple.com>", to='"Jürgen, Sales" <jürgen@example.com>')
    assert m.sender == "Zoë <zoe@exämple.com>"
    assert m.to == ('"Jürgen, Sales" <jürgen@example.com>',)


# -- one address per string (issue 14): several recipients only as a list --

SEVERAL = [
    "ann@example.com, attacker@evil.com",
    "ann@example.com,attacker@evil.com",
    "ann@example.com; attacker@evil.com",
    "ann@example.com attacker@evil.com",
    "Ann <ann@example.com>, attacker@evil.com",
    "Ann <ann@example.com>, Eve <attacker@evil.com>",
    '"Ann" <ann@example.com>, "Eve" <attacker@evil.com>',
    "<ann@example.com> <attacker@evil.com>",
    "ann@example.com <attacker@evil.com>",
    "alice@example.org)<attacker@evil.com>",  # CVE-2023-27043's shape: parsed differently by patch level
    "alice@example.org<attacker@evil.com>",
    "Team: ann@example.com, attacker@evil.com;",  # a group
    "ann@example.com (Ann)",  # a comment
    "ann@example.com\tattacker@evil.com",
]


@pytest.mark.parametrize("text", SEVERAL)
@pytest.mark.parametrize("field", ["to", "cc", "bcc", "reply_to"])
def test_a_string_is_exactly_one_address_never_several(text: str, field: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        build(**{field: text})
    assert info.value.field == field
    assert "attacker" not in str(info.value) and "ann@" not in str(info.value)  # errors never quote addresses


@pytest.mark.parametrize("text", SEVERAL)
def test_the_sender_is_one_address_too(text: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        build(sender=text)
    assert info.value.field == "from"


@pytest.mark.parametrize("text,name,addr", [
    ("ann@Example.COM", "", "ann@example.com"),
    ("  ann@example.com  ", "", "ann@example.com"),
    ("<ann@example.com>", "", "ann@example.com"),
    ("Ann <ann@example.com>", "Ann", "ann@example.com"),
    ("Ann B. Smith <ann@example.com>", "Ann B. Smith", "ann@example.com"),
    ("Ann   Smith<ann@example.com>", "Ann Smith", "ann@example.com"),
    ('"Smith, Ann" <ann@example.com>', "Smith, Ann", "ann@example.com"),
    ('"Ann \\"The\\" Smith" <ann@example.com>', 'Ann "The" Smith', "ann@example.com"),
    ('"ann@example.com" <ann@example.com>', "ann@example.com", "ann@example.com"),
    ("Zoë <zoe@EXÄMPLE.com>", "Zoë", "zoe@exämple.com"),
    ("zoe@xn--exmple-cua.com", "", "zoe@exämple.com"),  # punycode read back as Unicode
    ("j\u0075\u0308rgen@example.com", "", "j\u00fcrgen@example.com"),  # NFD local part made NFC
])
def test_one_address_parses_the_same_everywhere(text: str, name: str, addr: str) -> None:
    assert parse_address(text) == (name, addr)
    formatted = format_address(text)
    assert split_address(formatted) == (name, addr)
    assert format_address(formatted) == formatted  # idempotent: a stored message re-validates unchanged


def test_no_stdlib_address_parsing_is_relied_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """getaddresses/parseaddr behave differently by Python patch level (CVE-2023-27043): never called."""
    import email.utils

    from idemmail_celery.keys import normalize_address, normalize_addresses

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("email.utils address parsing used")

    monkeypatch.setattr(email.utils, "getaddresses", refuse)
    monkeypatch.setattr(email.utils, "parseaddr", refuse)
    for name, module in list(sys.modules.items()):  # and every copy imported by name
        if name.startswith("idemmail_celery"):
            for attr in ("getaddresses", "parseaddr"):
                if hasattr(module, attr):
                    monkeypatch.setattr(module, attr, refuse)
    m = build(sender='"Shop, Inc." <shop@example.com>', to=["Ann <ann@example.com>", "bob@example.org"],
              cc="Zoë <zoe@exämple.com>", reply_to="help@example.com")
    assert m.recipients() == ("ann@example.com", "bob@example.org", "zoe@exämple.com")
    m.to_mime(message_id="<k@example.com>").as_bytes(policy=__import__("email").policy.SMTPUTF8)
    assert normalize_address("Ann <Ann@Example.COM>") == "Ann@example.com"
    assert normalize_addresses(["Ann <a@B.com>", "b@c.com"]) == ["a@b.com", "b@c.com"]


def test_an_empty_cc_bcc_or_reply_to_string_is_no_address() -> None:
    m = build(cc="", bcc="  ", reply_to="")
    assert (m.cc, m.bcc, m.reply_to) == ((), (), ())
    with pytest.raises(InvalidEmail) as info:
        build(to="", cc=None)
    assert info.value.field == "to"
    with pytest.raises(InvalidEmail) as info:
        build(cc=["a@example.com", ""])  # inside a list, an empty entry is a mistake
    assert info.value.field == "cc" and "cc[1]" in str(info.value)


@pytest.mark.parametrize("kw,field", [
    ({"to": 42}, "to"),
    ({"to": b"ann@example.com"}, "to"),
    ({"cc": {"ann@example.com": 1}}, "cc"),
    ({"bcc": ["ann@example.com", 7]}, "bcc"),
])
def test_recipients_must_be_strings_or_lists_of_them(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        build(**kw)
    assert info.value.field == field


# -- recipients per message --


def addresses(n: int, prefix: str = "r") -> list[str]:
    return [f"{prefix}{i}@example.com" for i in range(n)]


def test_recipient_cap_counts_to_cc_and_bcc_together() -> None:
    assert DEFAULT_MAX_RECIPIENTS == 50
    assert len(build(to=addresses(30), cc=addresses(10, "c"), bcc=addresses(10, "b")).recipients()) == 50
    for kw, field in [({"to": addresses(51)}, "to"),
                      ({"to": addresses(30), "cc": addresses(21, "c")}, "cc"),
                      ({"to": addresses(30), "cc": addresses(10, "c"), "bcc": addresses(11, "b")}, "bcc"),
                      ({"reply_to": addresses(51)}, "reply_to")]:
        with pytest.raises(InvalidEmail, match="more than 50") as info:
            build(**kw)
        assert info.value.field == field
    with pytest.raises(InvalidEmail, match="more than 3"):
        build(to=addresses(4), max_recipients=3)


def test_recipient_cap_is_checked_before_parsing_a_huge_list() -> None:
    def endless() -> Any:
        n = 0
        while True:
            n += 1
            yield f"r{n}@example.com"

    with pytest.raises(InvalidEmail, match="more than 50"):
        build(to=endless())


# -- header fields: no control character or line separator anywhere, strict header names --

SEPARATORS = ["\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1b", "\x7f", "\x9b", "\r", "\n", "\0", "\ud800"]


@pytest.mark.parametrize("char", SEPARATORS, ids=lambda c: f"U+{ord(c):04X}")
def test_every_control_and_line_separator_is_refused_in_every_header_field(char: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"subject": f"Hi{char}Bcc: victim@example.com"}, "subject"),
        ({"sender": f"Shop{char}Bcc <shop@example.com>"}, "from"),
        ({"to": f"Ann{char} <ann@example.com>"}, "to"),
        ({"cc": [f"Ann{char} <ann@example.com>"]}, "cc"),
        ({"reply_to": f"ann@example.com{char}"}, "reply_to"),
        ({"headers": {"X-Campaign": f"nov{char}Bcc: victim@example.com"}}, "headers[X-Campaign]"),
        ({"headers": {f"X-Camp{char}aign": "nov"}}, "headers"),
        ({"tags": {"k": f"v{char}"}}, "tags[k]"),
        ({"tags": {f"k{char}": "v"}}, "tags"),
        ({"attachments": [Attachment(f"a{char}.txt", b"x")]}, "attachments.filename"),
        ({"attachments": [Attachment("a.txt", b"x", f"text/plain{char}")]}, "attachments.content_type"),
    ]
    for kw, field in cases:
        with pytest.raises(InvalidEmail) as info:
            build(**kw)
        assert info.value.field == field, kw


def test_tab_is_allowed_where_rfc_5322_allows_it_and_nowhere_else() -> None:
    m = build(subject="Order\t4821", headers={"X-Note": "a\tb"})
    assert m.subject == "Order\t4821" and m.headers == {"X-Note": "a\tb"}
    for kw, field in [({"to": "Ann\t<ann@example.com>"}, "to"), ({"tags": {"k": "a\tb"}}, "tags[k]"),
                      ({"headers": {"X-A\tB": "v"}}, "headers")]:
        with pytest.raises(InvalidEmail) as info:
            build(**kw)
        assert info.value.field == field


@pytest.mark.parametrize("name", [
    "From", "to", "CC", "Bcc", "Subject", "Sender", "Message-ID", "message-id", "Date", "Reply-To",
    "Content-Type", "content-transfer-encoding", "Content-Disposition", "MIME-Version", "Return-Path",
    "Received", "Resent-To", "DKIM-Signature", "X-Idemmail-Key",
])
def test_reserved_header_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        build(headers={name: "v"})
    assert info.value.field == "headers"


@pytest.mark.parametrize("name", ["X-Ünicode", "X:Y", "", "X Y", "X" * 77])
def test_header_names_are_rfc_5322_field_names(name: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        build(headers={name: "v"})
    assert info.value.field == "headers"


def test_ordinary_headers_pass_and_reach_the_mime_message() -> None:
    extra = {"X-Campaign": "nov", "List-Unsubscribe": "<https://shop.example/u/1>", "In-Reply-To": "<a@b.c>",
             "References": "<a@b.c>"}
    mime = build(headers=extra).to_mime().as_bytes()
    assert b"X-Campaign: nov" in mime and b"List-Unsubscribe: <https://shop.example/u/1>" in mime
    with pytest.raises(InvalidEmail, match="twice") as info:
        build(headers={"X-Tag": "a", "x-tag": "b"})
    assert info.value.field == "headers"


def test_bodies_refuse_what_no_email_can_carry() -> None:
    for kw, field in [({"text": "a\0b"}, "text"), ({"html": "<p>\ud800</p>"}, "html")]:
        with pytest.raises(InvalidEmail) as info:
            build(**kw)
        assert info.value.field == field
    assert build(text="line one\nline two\u2028still body").text  # bodies are not headers


# -- RFC 2047 encoded words: the stdlib decodes them, and a decoded CR LF would be a header line of its own --

# CR LF, then "Reply-To: evil@attacker.example", as a q-encoded word (CVE-2024-6923 on an unpatched Python).
INJECTION = "=?utf-8?q?x=0D=0AReply-To=3A_evil=40attacker.example?="
# The same with a non-ASCII letter before the CR LF: the stdlib writes that decoded word encoded again, on every
# Python, so no raw line break reaches the bytes; a reader decodes the line break (CVE-2024-6923 patched or not).
REENCODED = "=?utf-8?q?=C3=BC=0D=0AReply-To=3A_evil=40attacker.example?="
# The same through two addresses of one list: the first opens the encoded word, the second closes it.
OPENER = "=?utf-8?b?" + base64.b64encode(b"\r\nBcc: eve@evil.example").decode() + " <ann@example.com>"
CLOSER = "x?= <bob@example.com>"

ENCODED_WORDS: list[tuple[dict[str, Any], str]] = [
    ({"subject": INJECTION}, "subject"),
    ({"subject": f"Your order {INJECTION} has shipped"}, "subject"),
    ({"subject": f"Order{INJECTION}"}, "subject"),  # inside a word: the stdlib decodes that too
    ({"sender": f"{INJECTION} <shop@example.com>"}, "from"),
    ({"to": f"{INJECTION} <ann@example.com>"}, "to"),
    ({"to": f'"{INJECTION}" <ann@example.com>'}, "to"),  # inside a quoted display name too
    ({"to": f"{INJECTION}@example.com"}, "to"),  # a local part may hold "=" and "?"
    ({"to": [OPENER, CLOSER]}, "to"),
    ({"cc": [f"{INJECTION} <cc@example.com>"]}, "cc"),
    ({"bcc": f"{INJECTION} <bcc@example.com>"}, "bcc"),
    ({"reply_to": [OPENER, CLOSER]}, "reply_to"),
    ({"headers": {"X-Campaign": INJECTION}}, "headers[X-Campaign]"),
    ({"tags": {"k": INJECTION}}, "tags[k]"),
    ({"attachments": [Attachment(f"{INJECTION}.pdf", b"%PDF")]}, "attachments.filename"),
    ({"subject": f"Your order {REENCODED} has shipped"}, "subject"),
    ({"to": f"{REENCODED} <ann@example.com>"}, "to"),
    ({"reply_to": f'"{REENCODED}" <help@example.com>'}, "reply_to"),
    ({"headers": {"X-Campaign": REENCODED}}, "headers[X-Campaign]"),
    ({"attachments": [Attachment(f"{REENCODED}.pdf", b"%PDF")]}, "attachments.filename"),
]


def unchecked(**kw: Any) -> EmailMessage:
    """A message made without :meth:`EmailMessage.build`: what a message published by name arrives as."""
    fields: dict[str, Any] = {"sender": "Shop <shop@example.com>", "to": ("ann@example.com",), "subject": "Hi",
                              "text": "hello"}
    fields.update({k: (v,) if k in ("to", "cc", "bcc", "reply_to") and isinstance(v, str) else
                   tuple(v) if isinstance(v, list) else v for k, v in kw.items()})
    return EmailMessage(**fields)


def header_lines(raw: bytes) -> list[bytes]:
    """The header block of a generated message, one entry per header (continuation lines joined)."""
    lines: list[bytes] = []
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line[:1] in (b" ", b"\t"):
            lines[-1] += line
        else:
            lines.append(line)
    return lines


@pytest.mark.parametrize("kw,field", ENCODED_WORDS)
def test_an_encoded_word_is_refused_in_every_header_field_at_delay_and_again_at_the_worker(
        kw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidEmail) as info:
        build(**kw)  # delay()
    assert info.value.field == field
    assert "encoded word" in str(info.value) and "attacker" not in str(info.value) and "ann@" not in str(info.value)
    with pytest.raises(InvalidEmail) as info:
        EmailMessage.from_payload(unchecked(**kw).to_payload())  # the worker, whoever published the message
    assert info.value.field == field


@pytest.mark.parametrize("kw,field", ENCODED_WORDS)
def test_to_mime_never_writes_an_injected_header_line_even_for_a_message_build_did_not_check(
        kw: dict[str, Any], field: str) -> None:
    message = unchecked(**kw)
    if field in ("bcc", "tags[k]"):  # never written into the headers: nothing to inject into
        raw = message.to_mime().as_bytes()
        assert b"attacker" not in raw and [line.split(b":")[0] for line in header_lines(raw)] == [
            b"From", b"To", b"Subject", b"Content-Type", b"Content-Transfer-Encoding", b"MIME-Version"]
        return
    with pytest.raises(InvalidEmail) as info:
        message.to_mime().as_bytes()
    assert info.value.field == field


def test_text_that_only_resembles_an_encoded_word_is_sent_as_written_and_adds_no_header() -> None:
    m = build(subject="Quiz: 2+2=? Grüße aus Köln, " + "und noch mehr Text " * 6, headers={"X-Note": "a=?b"},
              to="Zoë Doe <zoe@example.com>", cc="cc@example.com", reply_to="help@example.com",
              attachments=[Attachment("Bericht (März)=?.pdf", b"%PDF", "application/pdf")])
    raw = m.to_mime().as_bytes()
    names = [line.split(b":", 1)[0] for line in header_lines(raw)]
    assert names == [b"From", b"To", b"Cc", b"Reply-To", b"Subject", b"X-Note", b"MIME-Version", b"Content-Type"]
    parsed = email.message_from_bytes(raw, policy=email.policy.default)
    assert parsed["Subject"] == m.subject and parsed["X-Note"] == "a=?b"
    assert [str(a) for a in parsed["To"].addresses] == ["Zoë Doe <zoe@example.com>"]
    assert [p.get_filename() for p in parsed.iter_attachments()] == ["Bericht (März)=?.pdf"]
