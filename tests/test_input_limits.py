"""Bounded, clean input: one size budget over every byte stored or sent, bounds on headers, tags and
attachments in line with what providers accept, RFC 5322 line limits,
no invisible or direction-changing characters, IDNA domains without mixed-script look-alikes,
RFC 5321 local parts, no composite MIME attachments.

Each rule is checked at ``delay()`` (nothing enqueued) and by the worker's own check
(``task.apply``: a message published by name, no ``delay()`` in front), which sends nothing.
A real app on a SQLite ledger and the file provider (one ``.eml`` per delivered email).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from idemmail_celery import IdempotentTask
from idemmail_celery.email import (
    MAX_ATTACHMENTS,
    MAX_DISPLAY_NAME_OCTETS,
    MAX_FILENAME_CHARS,
    MAX_HEADER_VALUE_CHARS,
    MAX_HEADERS,
    MAX_SUBJECT_OCTETS,
    MAX_TAG_CHARS,
    MAX_TAGS,
    PART_OVERHEAD,
    EmailMessage,
)
from idemmail_celery.encoding import MAX_NESTING, arguments_problem
from idemmail_celery.errors import InvalidEmail, PermanentSendError, UnserializableArgumentsError
from idemmail_celery.mail import ARGUMENT_SLACK, register

from .conftest import unique

LIMIT = 16 * 1024


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

def largest_tags() -> dict[str, str]:
    return {f"{i:03d}".ljust(MAX_TAG_CHARS, "t"): "v" * MAX_TAG_CHARS for i in range(MAX_TAGS)}


def largest_headers() -> dict[str, str]:
    return {f"X-{i:03d}".ljust(76, "h"): "v" * MAX_HEADER_VALUE_CHARS for i in range(MAX_HEADERS)}


def longest_names() -> list[dict[str, str]]:
    return [attachment(name=f"{i:03d}".ljust(MAX_FILENAME_CHARS, "n")) for i in range(MAX_ATTACHMENTS)]


@pytest.mark.parametrize("kw", [
    {"tags": largest_tags()},
    {"attachments": longest_names()},
    {"attachments": [attachment() for _ in range(LIMIT // PART_OVERHEAD + 1)]},
    {"headers": largest_headers()},
    {"event_id": "e" * LIMIT},
    {"template": "t" * LIMIT},
    {"tenant": "t" * LIMIT},
], ids=["tags", "attachment-names", "attachment-count", "headers", "event_id", "template", "tenant"])
def test_every_byte_stored_or_sent_counts_towards_the_size_budget(app: Celery, tmp_path: Path,
                                                                  kw: dict[str, Any]) -> None:
    refused_everywhere(app, tmp_path, base(**kw), "size")


def test_the_budget_counts_base64_and_a_parts_overhead_and_a_message_under_it_is_sent(
        app: Celery, tmp_path: Path) -> None:
    message = EmailMessage.build(sender="s@example.com", to="ann@example.com", subject="x", text="y",
                                 tags={"k": "v"}, attachments=[attachment(name="ab", content=b"1234")])
    assert message.size() == len("s@example.comxyann@example.comkvabtext/plain") + 8 + PART_OVERHEAD
    app.tasks["idemmail_celery.send_email"].apply(kwargs=base(tags={"t": "v" * MAX_TAG_CHARS}))
    assert len(delivered(tmp_path)) == 1


def test_attachments_beyond_the_count_limit_are_refused_before_any_is_parsed() -> None:
    endless = (attachment() for _ in range(10 * MAX_ATTACHMENTS))
    with pytest.raises(InvalidEmail) as info:
        EmailMessage.build(sender="s@example.com", to="ann@example.com", subject="x", text="y", attachments=endless,
                           max_bytes=10**9)
    assert info.value.field == "attachments"


# -- bounds on what a message may hold, beyond its size (issue 35) --

OVER_A_BOUND = {
    "headers": ({"headers": {f"X-{i}": "v" for i in range(MAX_HEADERS + 1)}}, "headers"),
    "header-value": ({"headers": {"X-Long": "v" * (MAX_HEADER_VALUE_CHARS + 1)}}, "headers[X-Long]"),
    "tags": ({"tags": {f"t{i}": "v" for i in range(MAX_TAGS + 1)}}, "tags"),
    "tag-name": ({"tags": {"t" * (MAX_TAG_CHARS + 1): "v"}}, "tags"),
    "tag-value": ({"tags": {"t": "v" * (MAX_TAG_CHARS + 1)}}, "tags[t]"),
    "attachments": ({"attachments": [attachment(f"{i}.txt") for i in range(MAX_ATTACHMENTS + 1)]}, "attachments"),
    "attachment-name": ({"attachments": [attachment(name="n" * (MAX_FILENAME_CHARS + 1))]}, "attachments.filename"),
}


@pytest.mark.parametrize("case", OVER_A_BOUND.values(), ids=OVER_A_BOUND.keys())
def test_a_message_over_a_bound_is_refused_at_delay_and_by_the_worker(
        app: Celery, tmp_path: Path, case: tuple[dict[str, Any], str]) -> None:
    kw, field = case
    refused_everywhere(app, tmp_path, base(**kw), field)


def test_a_message_at_every_bound_is_valid() -> None:
    message = EmailMessage.build(
        sender="s@example.com", to=[f"r{i}@example.com" for i in range(50)], subject="x", text="y",
        headers=largest_headers(), tags=largest_tags(), attachments=longest_names())
    assert (len(message.headers), len(message.tags), len(message.attachments)) == (MAX_HEADERS, MAX_TAGS,
                                                                                   MAX_ATTACHMENTS)


def test_an_oversized_mapping_is_refused_before_any_entry_is_looked_at() -> None:
    class Counted(dict[str, str]):
        looked = 0

        def items(self) -> Any:
            Counted.looked += 1
            return super().items()

    with pytest.raises(InvalidEmail) as info:
        EmailMessage.build(sender="s@example.com", to="ann@example.com", subject="x", text="y",
                           tags=Counted({f"t{i}": "v" for i in range(100_000)}))
    assert info.value.field == "tags" and Counted.looked == 0


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


SPELLED_WITH_JOINERS = {
    # Persian: "mikhaham" and the name Alireza are written with a ZWNJ between joining letters.
    "persian-subject": {"subject": "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645"},
    "persian-name": {"to": "\u0639\u0644\u06cc\u200c\u0631\u0636\u0627 <ali@example.com>"},
    # Hindi: a ZWJ after a virama chooses the half form of the consonant.
    "hindi-subject": {"subject": "\u0915\u094d\u200d\u0937"},
    # The flag of Scotland: a black flag, the tags "gbsct" and CANCEL TAG.
    "flag-subject": {"subject": "Go \U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f!"},
}


@pytest.mark.parametrize("kw", SPELLED_WITH_JOINERS.values(), ids=SPELLED_WITH_JOINERS.keys())
def test_joiners_that_spell_a_word_or_a_flag_are_accepted(app: Celery, tmp_path: Path, kw: dict[str, str]) -> None:
    # The characters are refused elsewhere (test above); here they are how the language or the emoji is written.
    app.tasks["idemmail_celery.send_email"].delay(**base(**kw))  # accepted at delay(): no InvalidEmail
    app.tasks["idemmail_celery.send_email"].apply(kwargs=base(**kw))
    assert len(delivered(tmp_path)) == 1


@pytest.mark.parametrize("subject", ["pay\u200cpal", "a\U000e0067\U000e007f", "\U0001f3f4\U000e0067 tail"])
def test_joiners_and_tags_out_of_their_context_are_refused(app: Celery, tmp_path: Path, subject: str) -> None:
    refused_everywhere(app, tmp_path, base(subject=subject), "subject")


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


# -- task arguments: how deep and how big, the same rule at delay() and before the pool (issue 35) --

def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def test_arguments_nested_past_the_limit_are_refused_at_delay_as_the_worker_refuses_them(app: Celery) -> None:
    @app.task(shared=False, base=IdempotentTask, name=unique("deep"))
    def remember(note: Any) -> None:
        pass

    remember.delay(nested(MAX_NESTING))
    assert arguments_problem([nested(MAX_NESTING)], {}) is None
    for call in ((nested(MAX_NESTING + 1),), (nested(850),)):
        with pytest.raises(UnserializableArgumentsError, match="nested more than 100 levels"):
            remember.delay(*call)
        assert arguments_problem(list(call), {}) == "task arguments nested more than 100 levels deep"
    assert arguments_problem([], {"note": {"a": nested(MAX_NESTING)}}) is not None  # a mapping is a level too


@pytest.mark.parametrize("value", [
    {"to": ["ann@example.com"] * 3, "tags": {"t": "v"}, "n": [1, 2.5, None, True]},
    {"k": "\u00e9\U0001f600" * 10, "b": [[[]], {}], "e": ""},
])
def test_the_size_of_arguments_is_never_more_than_their_json(value: dict[str, Any]) -> None:
    size = len(json.dumps([[], value]))
    assert arguments_problem([], value, size) is None
    assert arguments_problem([], value, 1) == "task arguments are larger than 1 (characters and values)"


def test_send_email_arguments_over_the_budget_are_refused_at_delay_however_they_are_spelled(app: Celery) -> None:
    # An address padded with white space is one address once parsed, and the message is small; the arguments
    # are not, and a worker refuses them before its pool: so does delay().
    padded = " " * (LIMIT + ARGUMENT_SLACK) + "ann@example.com"
    with pytest.raises(UnserializableArgumentsError, match="larger than"):
        app.tasks["idemmail_celery.send_email"].delay(**base(to=padded))
