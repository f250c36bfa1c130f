"""Bounded, clean input: one size budget over every byte stored or sent, RFC 5322 line limits,
no invisible or direction-changing characters, IDNA domains without mixed-script look-alikes,
RFC 5321 local parts, no composite MIME attachments.

Each rule is checked at ``delay()`` (nothing enqueued) and by the worker's own check
(``task.apply``: a message published by name, no ``delay()`` in front), which sends nothing.
A real app on a SQLite ledger and the file provider (one ``.eml`` per delivered email).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from idemmail_celery.email import (
    MAX_ATTACHMENTS,
    MAX_DISPLAY_NAME_OCTETS,
    MAX_SUBJECT_OCTETS,
    PART_OVERHEAD,
    EmailMessage,
)
from idemmail_celery.errors import InvalidEmail, PermanentSendError
from idemmail_celery.mail import register

from .conftest import unique

LIMIT = 64 * 1024


@pytest.fixture
def app(tmp_path: Path) -> Celery:
    a = Celery(unique("in"), broker="memory://", set_as_current=False)
    a.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", idemmail_key_secret="s",
                  idemmail_provider_url=f"file://{tmp_path / 'out'}", idemmail_default_from="Shop <shop@example.com>",
                  idemmail_max_message_bytes=LIMIT)
    register(a)
    return a


def delivered(tmp_path: Path) -> list[Path]:
    out = tmp_path / "out"
    return sorted(out.iterdir()) if out.exists() else []


def refused_everywhere(app: Celery, tmp_path: Path, call: dict[str, Any], field: str) -> None:
    """Refused at delay() naming ``field``, and by the worker (nothing sent, failed as invalid_email)."""
    task = app.tasks["idemmail_celery.send_email"]
    with pytest.raises(InvalidEmail) as info:
        task.delay(**call)
    assert info.value.field == field
    outcome = task.apply(kwargs=call)
    assert isinstance(outcome.result, PermanentSendError) and outcome.result.reason == "invalid_email"
    assert delivered(tmp_path) == []


def base(**kw: Any) -> dict[str, Any]:
    return {"to": "ann@example.com", "subject": "Your order", "text": "It has shipped.", "event_id": "o-1", **kw}


def attachment(name: str = "a.txt", content: bytes = b"", content_type: str = "text/plain") -> dict[str, str]:
    return {"filename": name, "content_type": content_type, "content_b64": base64.b64encode(content).decode()}


# -- one budget over every byte --

@pytest.mark.parametrize("kw", [
    {"tags": {"t": "v" * LIMIT}},
    {"tags": {"t" * LIMIT: "v"}},
    {"attachments": [attachment(name="n" * LIMIT)]},
    {"attachments": [attachment() for _ in range(LIMIT // PART_OVERHEAD + 1)]},
    {"headers": {"X-Long": "v" * LIMIT}},
    {"event_id": "e" * LIMIT},
    {"template": "t" * LIMIT},
    {"tenant": "t" * LIMIT},
], ids=["tag-value", "tag-name", "attachment-name", "attachment-count", "header", "event_id", "template", "tenant"])
def test_every_byte_stored_or_sent_counts_towards_the_size_budget(app: Celery, tmp_path: Path,
                                                                  kw: dict[str, Any]) -> None:
    refused_everywhere(app, tmp_path, base(**kw), "size")


def test_the_budget_counts_base64_and_a_parts_overhead_and_a_message_under_it_is_sent(
        app: Celery, tmp_path: Path) -> None:
    message = EmailMessage.build(sender="s@example.com", to="ann@example.com", subject="x", text="y",
                                 tags={"k": "v"}, attachments=[attachment(name="ab", content=b"1234")])
    assert message.size() == len("s@example.comxyann@example.comkvabtext/plain") + 8 + PART_OVERHEAD
    app.tasks["idemmail_celery.send_email"].apply(kwargs=base(tags={"t": "v" * 1000}))
    assert len(delivered(tmp_path)) == 1


def test_attachments_beyond_the_count_limit_are_refused_before_any_is_parsed() -> None:
    endless = (attachment() for _ in range(10 * MAX_ATTACHMENTS))
    with pytest.raises(InvalidEmail) as info:
        EmailMessage.build(sender="s@example.com", to="ann@example.com", subject="x", text="y", attachments=endless,
                           max_bytes=10**9)
    assert info.value.field == "attachments"


# -- RFC 5322 line limits, RFC 5321 local parts --

def test_a_subject_over_one_line_is_refused(app: Celery, tmp_path: Path) -> None:
    app.tasks["idemmail_celery.send_email"].apply(kwargs=base(subject="s" * MAX_SUBJECT_OCTETS))
    assert len(delivered(tmp_path)) == 1
    refused_everywhere(app, tmp_path / "none", base(subject="s" * (MAX_SUBJECT_OCTETS + 1)), "subject")
    refused_everywhere(app, tmp_path / "none", base(subject="\u00e9" * (MAX_SUBJECT_OCTETS // 2 + 1)), "subject")


def test_a_display_name_over_its_line_is_refused(app: Celery, tmp_path: Path) -> None:
    refused_everywhere(app, tmp_path, base(to=f"{'N' * (MAX_DISPLAY_NAME_OCTETS + 1)} <ann@example.com>"), "to")


def test_a_local_part_over_64_octets_is_refused(app: Celery, tmp_path: Path) -> None:
    refused_everywhere(app, tmp_path, base(to="a" * 65 + "@example.com"), "to")
    app.tasks["idemmail_celery.send_email"].apply(kwargs=base(to="a" * 64 + "@example.com"))
    assert len(delivered(tmp_path)) == 1


# -- invisible and direction-changing characters --

INVISIBLE = ["\u202e", "\u202a", "\u2066", "\u2069", "\u200e", "\u200f", "\u061c", "\u200b", "\u200c", "\u200d",
             "\u2060", "\ufeff", "\U000e0001", "\U000e0041", "\U000e007f"]


@pytest.mark.parametrize("char", INVISIBLE, ids=[f"U+{ord(c):04X}" for c in INVISIBLE])
@pytest.mark.parametrize("where", ["subject", "to", "display-name", "from", "attachment-name"])
def test_invisible_and_bidi_characters_are_refused(app: Celery, tmp_path: Path, char: str, where: str) -> None:
    kw, field = {
        "subject": ({"subject": f"Your order{char}"}, "subject"),
        "to": ({"to": f"an{char}n@example.com"}, "to"),
        "display-name": ({"to": f"Ann{char} Smith <ann@example.com>"}, "to"),
        "from": ({"from_": f"Sh{char}op <shop@example.com>"}, "from"),
        "attachment-name": ({"attachments": [attachment(name=f"invoice{char}fdp.exe")]}, "attachments.filename"),
    }[where]
    refused_everywhere(app, tmp_path, base(**kw), field)


def test_a_zero_width_joiner_inside_an_emoji_sequence_is_accepted(app: Celery, tmp_path: Path) -> None:
    family = "\U0001f468\u200d\U0001f469\u200d\U0001f467"
    app.tasks["idemmail_celery.send_email"].apply(kwargs=base(subject=f"From all of us {family}"))
    assert len(delivered(tmp_path)) == 1


# -- domains: IDNA 2008 / UTS 46, no mixed-script labels --

def test_a_mixed_script_domain_is_refused_unless_allowed(app: Celery, tmp_path: Path) -> None:
    look_alike = "ann@ex\u0430mple.com"  # a Cyrillic a among Latin letters
    refused_everywhere(app, tmp_path, base(to=look_alike), "to")
    refused_everywhere(app, tmp_path, base(from_="Shop <shop@p\u0430ypal.com>"), "from")
    app.conf.idemmail_allow_mixed_script_domains = True
    allowed = app.tasks["idemmail_celery.send_email"]
    allowed._idem_settings = None  # settings are resolved once per task: read the change
    allowed.apply(kwargs=base(to=look_alike))
    assert len(delivered(tmp_path)) == 1


@pytest.mark.parametrize("to", [
    "ann@b\u00fccher.example", "ann@\u4f8b\u3048.jp", "ann@\u043f\u0440\u0438\u043c\u0435\u0440.\u0440\u0444",
    "ann@xn--bcher-kva.example", "ann@\u30c6\u30b9\u30c8ab.jp"])
def test_single_script_and_cjk_domains_are_accepted(app: Celery, tmp_path: Path, to: str) -> None:
    app.tasks["idemmail_celery.send_email"].apply(kwargs=base(to=to))
    assert len(delivered(tmp_path)) == 1


def test_a_domain_idna_2008_refuses_is_refused(app: Celery, tmp_path: Path) -> None:
    refused_everywhere(app, tmp_path, base(to="ann@a\u2615.example"), "to")  # a symbol: not IDNA 2008


# -- composite MIME types --

@pytest.mark.parametrize("content_type", ["multipart/mixed", "message/rfc822", "Multipart/Alternative"])
def test_a_composite_mime_type_is_refused_as_an_attachment(app: Celery, tmp_path: Path, content_type: str) -> None:
    refused_everywhere(app, tmp_path, base(attachments=[attachment(content_type=content_type)]),
                       "attachments.content_type")


# -- refusals never quote an address (they reach the result backend: a campaign raises them as they are) --

@pytest.mark.parametrize("kw", [
    {"tags": {"to ann.private@example.com": "v"}},
    {"tags": {"ann.private@example.com": "v\n"}},
    {"headers": {"X-ann.private@example.com": "v\n"}},
    {"headers": {"X-ann.private@example.com": "a", "x-ANN.private@example.com": "b"}},
    {"headers": {"X-ann.private@example.com": 1}},
], ids=["tag-name", "tag-value", "header-value", "header-twice", "header-type"])
def test_a_refusal_naming_a_tag_or_header_shaped_like_an_address_does_not_quote_it(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidEmail) as info:
        EmailMessage.build(sender="s@example.com", to="bob@example.com", subject="x", text="y", **kw)
    assert "ann.private" not in repr(info.value.args) and "ann.private" not in info.value.field
