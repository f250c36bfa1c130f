"""The email message: a typed value, checked before anything is enqueued.

:class:`EmailMessage` is what ``send_email`` carries and every provider sends. :meth:`EmailMessage.build`
checks every field and raises :class:`~idemmail_celery.errors.InvalidEmail` naming it (``.field``), never
quoting an address; what is refused, and why, is in docs/security.md ("What is refused, and where").
:meth:`EmailMessage.to_mime` builds the RFC 5322 message deterministically: a retry is byte-identical.
"""

from __future__ import annotations

import base64
import email.policy
import functools
import hashlib
import itertools
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from email.headerregistry import Address
from email.message import EmailMessage as MIMEMessage
from typing import Any

import idna
from email_validator import EmailNotValidError, validate_email

from .errors import InvalidEmail
from .redaction import scrub

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
#: Recipients (to, cc and bcc together) one message may have: Resend, Postmark and SES take 50.
DEFAULT_MAX_RECIPIENTS = 50
#: Attachments one message may have (no provider publishes a count; each MIME part takes ~0.5 ms to build).
MAX_ATTACHMENTS = 100
#: Characters in an attachment's file name: what most file systems take.
MAX_FILENAME_CHARS = 255
#: Custom headers (``headers=``) one message may have: every one is written into each copy sent.
MAX_HEADERS = 50
#: Characters in a ``headers=`` value: SES's limit, which a folded header fits.
MAX_HEADER_VALUE_CHARS = 870
#: Tags one message may have (Resend takes 75; keyless providers add one of the library's own).
MAX_TAGS = 50
#: Characters in a tag's name and in its value: the limit of Resend and SES.
MAX_TAG_CHARS = 256
#: What :meth:`EmailMessage.size` counts per attachment for its MIME part's boundary and headers.
PART_OVERHEAD = 256
#: RFC 5322 lines are at most 998 octets: a subject fits on one after ``Subject: ``.
MAX_SUBJECT_OCTETS = 998 - len("Subject: ")
#: A display name fits on one line with the longest address and the longest field name it goes in.
MAX_DISPLAY_NAME_OCTETS = 998 - len("Reply-To: ") - len(' "" <>') - 254
#: RFC 5321 section 4.5.3.1.1.
MAX_LOCAL_PART_OCTETS = 64

#: Header names the library or the provider writes (``Content-*`` and ``Resent-*`` are refused as prefixes).
RESERVED_HEADERS = frozenset({
    "from", "sender", "to", "cc", "bcc", "reply-to", "subject", "date", "message-id", "mime-version",
    "return-path", "received", "dkim-signature", "x-idemmail-key",
})
_RESERVED_PREFIXES = ("content-", "resent-")

# C0 and C1 controls, DEL, line and paragraph separators, lone surrogates (no encoding can write them).
_BAD_IN_FIELD = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
# The same with TAB allowed, for unstructured values (subject, header values).
_BAD_IN_TEXT = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_BAD_IN_BODY = re.compile("[\x00\ud800-\udfff]")
# Bidi controls and marks, zero-width characters, word joiner, BOM, tag characters.
_INVISIBLE = re.compile("[\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c\u200b-\u200d\u2060\ufeff\U000e0000-\U000e007f]")
_ZWJ = "\u200d"
# A flag's emoji tag sequence (UTS 51: England, Scotland, Wales); tag characters elsewhere are hidden text.
_EMOJI_TAG_SEQUENCE = re.compile("\U0001f3f4[\U000e0020-\U000e007e]+\U000e007f")
# Scripts that may share a label (UTS 39 "highly restrictive": Japanese, Chinese, Korean names).
_SCRIPT_SETS = (frozenset({"LATIN", "HAN", "HIRAGANA", "KATAKANA"}), frozenset({"LATIN", "HAN", "BOPOMOFO"}),
                frozenset({"LATIN", "HAN", "HANGUL"}))


def _has_encoded_word(value: str) -> bool:
    """``=?`` then ``?=`` (two scans, no regex backtracking): broader than the stdlib's pattern, which has changed."""
    start = value.find("=?")
    return start >= 0 and value.find("?=", start + 2) >= 0


#: RFC 5322 field-name: printable US-ASCII except ":", no longer than fits on a line.
_FIELD_NAME = re.compile(r"[!-9;-~]{1,76}")
_MIME_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,64}/[A-Za-z0-9!#$&^_.+-]{1,64}")
# A display name's tokens: white space, a quoted string, a word (anything but RFC 5322 specials; "." stays
# allowed, as obs-phrase does: "Ann B. Smith"), or one special, which is refused.
_PHRASE_TOKEN = re.compile(r'[ \t]+|"((?:\\.|[^"\\])*)"|([^()<>\[\]:;@\\," \t]+)|(.)', re.DOTALL)
_QUOTED_PAIR = re.compile(r"\\(.)", re.DOTALL)


@dataclass(frozen=True)
class Attachment:
    """A file carried inside the message (keep it small: it travels through the broker)."""

    filename: str
    content: bytes
    content_type: str = "application/octet-stream"

    def to_payload(self) -> dict[str, str]:
        return {"filename": self.filename, "content_type": self.content_type,
                "content_b64": base64.b64encode(self.content).decode("ascii")}

    @classmethod
    def from_payload(cls, data: Mapping[str, Any]) -> Attachment:
        try:
            content = base64.b64decode(str(data["content_b64"]), validate=True)
            return cls(str(data["filename"]), content, str(data.get("content_type") or "application/octet-stream"))
        except (KeyError, ValueError, TypeError) as exc:
            raise InvalidEmail(f"attachment is malformed: {exc}", field="attachments") from exc


@dataclass(frozen=True)
class EmailMessage:
    """One email. Build it with :meth:`build`, which validates; addresses are stored as ``addr`` or ``Name <addr>``."""

    sender: str
    to: tuple[str, ...]
    subject: str
    text: str | None = None
    html: str | None = None
    cc: tuple[str, ...] = ()
    bcc: tuple[str, ...] = ()
    reply_to: tuple[str, ...] = ()
    headers: Mapping[str, str] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    attachments: tuple[Attachment, ...] = ()

    @classmethod
    def build(
        cls, *, sender: str, to: str | Iterable[str], subject: str, text: str | None = None, html: str | None = None,
        cc: str | Iterable[str] | None = None, bcc: str | Iterable[str] | None = None,
        reply_to: str | Iterable[str] | None = None, headers: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None, attachments: Iterable[Attachment | Mapping[str, Any]] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES, max_recipients: int = DEFAULT_MAX_RECIPIENTS,
        allow_mixed_scripts: bool = False,
    ) -> EmailMessage:
        """A validated message, or :class:`InvalidEmail` saying which field is wrong and why (``allow_mixed_scripts``:
        accept domain labels that mix scripts, look-alikes)."""
        attached = _attachments(attachments)
        listed = {where: _listed(v, where, max_recipients) for where, v in (("to", to), ("cc", cc), ("bcc", bcc))}
        total = 0
        for where, items in listed.items():
            total += len(items)
            if total > max_recipients:
                raise InvalidEmail(
                    f"more than {max_recipients} recipients (to, cc and bcc together; idemmail_max_recipients): "
                    "send one message per recipient, or a campaign", field=where)
        replies = _listed(reply_to, "reply_to", max_recipients)
        if len(replies) > max_recipients:
            raise InvalidEmail(f"more than {max_recipients} reply_to addresses", field="reply_to")
        message = cls(
            sender=_formatted([sender], "from", allow_mixed_scripts)[0],
            to=_formatted(listed["to"], "to", allow_mixed_scripts), subject=_subject(subject),
            text=_body(text, "text"), html=_body(html, "html"),
            cc=_formatted(listed["cc"], "cc", allow_mixed_scripts),
            bcc=_formatted(listed["bcc"], "bcc", allow_mixed_scripts),
            reply_to=_formatted(replies, "reply_to", allow_mixed_scripts), headers=_headers(headers), tags=_tags(tags),
            attachments=tuple(a if isinstance(a, Attachment) else Attachment.from_payload(a) for a in attached),
        )
        if not (message.to or message.cc or message.bcc):
            raise InvalidEmail("the message has no recipient", field="to")
        if message.text is None and message.html is None:
            raise InvalidEmail("the message has neither text nor html", field="text")
        for a in message.attachments:
            _header_text(a.filename, "attachments.filename")
            if not a.filename.strip():
                raise InvalidEmail("an attachment has no file name", field="attachments.filename")
            if len(a.filename) > MAX_FILENAME_CHARS:
                raise InvalidEmail(f"an attachment's file name is over {MAX_FILENAME_CHARS} characters",
                                   field="attachments.filename")
            if not _MIME_TYPE.fullmatch(_header_text(a.content_type, "attachments.content_type")):
                raise InvalidEmail("an attachment's content_type is not type/subtype", field="attachments.content_type")
            if a.content_type.lower().startswith(("multipart/", "message/")):
                raise InvalidEmail("an attachment's content_type may not be multipart/* or message/* (a composite "
                                   "type needs a MIME structure of its own); send it as application/octet-stream",
                                   field="attachments.content_type")
            if not isinstance(a.content, (bytes, bytearray)):
                raise InvalidEmail("an attachment's content must be bytes", field="attachments")
        size = message.size()
        if size > max_bytes:
            raise InvalidEmail(f"the message is {size} bytes, over the limit of {max_bytes}", field="size")
        return message

    def to_payload(self) -> dict[str, Any]:
        """The JSON form that travels in the task message and is stored as the first payload."""
        return {
            "from": self.sender, "to": list(self.to), "cc": list(self.cc), "bcc": list(self.bcc),
            "reply_to": list(self.reply_to), "subject": self.subject, "text": self.text, "html": self.html,
            "headers": dict(self.headers), "tags": dict(self.tags),
            "attachments": [a.to_payload() for a in self.attachments],
        }

    @classmethod
    def from_payload(
        cls, data: Mapping[str, Any], *, max_bytes: int = DEFAULT_MAX_BYTES,
        max_recipients: int = DEFAULT_MAX_RECIPIENTS, allow_mixed_scripts: bool = False,
    ) -> EmailMessage:
        """Rebuild a message from :meth:`to_payload` output, running every check again (as the worker does)."""
        return cls.build(
            sender=data.get("from", ""), to=data.get("to") or (), subject=data.get("subject", ""),
            text=data.get("text"), html=data.get("html"), cc=data.get("cc"), bcc=data.get("bcc"),
            reply_to=data.get("reply_to"), headers=data.get("headers"), tags=data.get("tags"),
            attachments=data.get("attachments"), max_bytes=max_bytes, max_recipients=max_recipients,
            allow_mixed_scripts=allow_mixed_scripts,
        )

    def recipients(self) -> tuple[str, ...]:
        """Every envelope recipient: to, cc and bcc, addresses only."""
        return tuple(split_address(a)[1] for a in (*self.to, *self.cc, *self.bcc))

    def personal_texts(self) -> tuple[str, ...]:
        """Addresses, display names and subject, for :func:`~idemmail_celery.redaction.scrub` (4 characters up)."""
        found: list[str] = []
        for formatted in (self.sender, *self.to, *self.cc, *self.bcc, *self.reply_to):
            name, addr = split_address(formatted)
            found.extend((addr, name, formatted))
        found.append(self.subject)
        return tuple(dict.fromkeys(t for t in (s.strip() for s in found) if len(t) >= 4))

    def size(self) -> int:
        """Every byte the message stores or sends, in UTF-8 (attachments in base64, plus :data:`PART_OVERHEAD` each)."""
        texts = itertools.chain(
            (self.sender, self.subject, self.text or "", self.html or ""), self.to, self.cc, self.bcc,
            self.reply_to, self.headers.keys(), self.headers.values(), self.tags.keys(), self.tags.values(),
            *((a.filename, a.content_type) for a in self.attachments))
        total = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        return total + sum(-(-len(a.content) // 3) * 4 + PART_OVERHEAD for a in self.attachments)

    def to_mime(self, *, message_id: str | None = None, date: str | None = None) -> MIMEMessage:
        """The RFC 5322 message, the same bytes for the same input (no random boundary, no implicit Date), Bcc
        left out (pass :meth:`recipients` as the envelope); a header that would add a line raises InvalidEmail."""
        msg = MIMEMessage(policy=email.policy.SMTP)
        msg["From"] = _mime_address(self.sender)
        msg["To"] = tuple(_mime_address(a) for a in self.to)
        if self.cc:
            msg["Cc"] = tuple(_mime_address(a) for a in self.cc)
        if self.reply_to:
            msg["Reply-To"] = tuple(_mime_address(a) for a in self.reply_to)
        msg["Subject"] = self.subject
        if message_id:
            msg["Message-ID"] = message_id
        if date:
            msg["Date"] = date
        for name, value in sorted(self.headers.items()):
            msg[name] = value
        if self.text is not None:
            msg.set_content(self.text)
        if self.html is not None:
            if self.text is None:
                msg.set_content(self.html, subtype="html")
            else:
                msg.add_alternative(self.html, subtype="html")
        for a in self.attachments:
            maintype, _, subtype = a.content_type.partition("/")
            msg.add_attachment(a.content, maintype=maintype or "application",
                               subtype=subtype or "octet-stream", filename=a.filename)
        seed = hashlib.sha256(repr(self.to_payload()).encode()).hexdigest()[:24]
        for n, part in enumerate(msg.walk()):
            if part is not msg:  # add_alternative and add_attachment give each part a MIME-Version: RFC 2045 does not
                del part["MIME-Version"]
            if part.is_multipart():  # boundaries from the content, not random ones
                part.set_boundary(f"=_idemmail_{seed}_{n}")
        _refuse_injected_lines(msg)
        return msg


def message_id_for(key: str, domain: str) -> str:
    """A Message-ID derived from the intent key: ``<key@domain>`` (the key is already a hash)."""
    return f"<{key}@{domain}>"


#: The :class:`EmailMessage` field a MIME header comes from.
_FIELD_OF_HEADER = {"from": "from", "to": "to", "cc": "cc", "reply-to": "reply_to", "subject": "subject",
                    "content-disposition": "attachments.filename"}


def _refuse_injected_lines(msg: MIMEMessage) -> None:
    # Behind build()'s checks: fold each header as the generator will and read it back as a mail program
    # would. Before CVE-2024-6923's fix a decoded CR LF is written raw, after it (and for non-ASCII on every
    # version) encoded again for the reader to decode: each check alone misses one.
    policy = msg.policy
    for part in msg.walk():
        for name, value in part.items():
            folded = policy.fold(name, value)
            lines = folded.split(policy.linesep)
            if lines[-1] == "":
                lines.pop()
            if any("\r" in line or "\n" in line for line in lines) or any(
                    line[:1] not in (" ", "\t") for line in lines[1:]) or _reads_back_a_line_break(policy, folded):
                where = _FIELD_OF_HEADER.get(name.lower(), _named("headers", name))
                raise InvalidEmail(f"{where} would write a header line of its own, or a line break a reader decodes "
                                   "(header injection through an RFC 2047 encoded word)", field=where)


def _reads_back_a_line_break(policy: email.policy.Policy, folded: str) -> bool:
    # A reader decodes only RFC 2047 words and RFC 2231 parameters: without them, skip the ~1 ms parse.
    if "=?" not in folded and "*=" not in folded:
        return False
    try:
        value = str(policy.header_fetch_parse(*policy.header_source_parse([folded])))
    except ValueError:  # an address part that decodes to CR or LF: the stdlib refuses to make the Address
        return True
    return "\r" in value or "\n" in value


def parse_address(value: Any, where: str = "address") -> tuple[str, str]:
    """Exactly one ``local@domain`` or ``Name <local@domain>`` as ``(name, addr-spec)`` normalised (domain lower-case
    Unicode, local part NFC), or :class:`InvalidEmail` (``field=where``); our own parser, the same on every Python."""
    text = _header_text(value, where).strip(" \t")
    if not text:
        raise InvalidEmail(f"{where} is empty", field=where)
    if "=?" in text:  # even unpaired: the stdlib reads a list of addresses as one text
        raise InvalidEmail(f"{where} contains '=?', which starts an RFC 2047 encoded word (header injection)",
                           field=where)
    if text.endswith(">"):
        start = text.rfind("<")  # an addr-spec holds no "<": the last one opens it
        if start < 0:
            raise InvalidEmail(f"{where} has a '>' without a '<'", field=where)
        name, spec = _phrase(text[:start], where), text[start + 1:-1].strip(" \t")
        if not spec:
            raise InvalidEmail(f"{where} has nothing between '<' and '>'", field=where)
    else:
        name, spec = "", text
    if "@" not in spec:
        raise InvalidEmail(f"{where} is not an email address", field=where)
    if any(c in spec for c in ",;<> \t"):
        raise InvalidEmail(f"{where} holds more than one address: pass several recipients as a list", field=where)
    if len(name.encode("utf-8", "surrogatepass")) > MAX_DISPLAY_NAME_OCTETS:
        raise InvalidEmail(f"{where} has a display name over {MAX_DISPLAY_NAME_OCTETS} octets (RFC 5322 line "
                           "limit)", field=where)
    try:
        normalized = _normalized_spec(spec)
    except EmailNotValidError as exc:
        raise InvalidEmail(f"{where} is not a valid address: {exc}", field=where) from None
    if len(normalized.rpartition("@")[0].encode("utf-8")) > MAX_LOCAL_PART_OCTETS:
        raise InvalidEmail(f"{where} has a local part over {MAX_LOCAL_PART_OCTETS} octets (RFC 5321)", field=where)
    return name, normalized


@functools.lru_cache(maxsize=4096)
def _normalized_spec(spec: str) -> str:
    """email-validator's normalised addr-spec (cached: ~80 us each, and every address is checked several times)."""
    return str(validate_email(spec, check_deliverability=False).normalized)


def format_address(value: Any, where: str = "address") -> str:
    """One address checked by :func:`parse_address` and written back: ``addr`` or ``Name <addr>``."""
    name, addr = parse_address(value, where)
    return str(_address(name, addr)) if name else addr


def split_address(formatted: str) -> tuple[str, str]:
    """``(display name, addr-spec)`` of an :class:`EmailMessage` address; anything else needs :func:`parse_address`."""
    if not formatted.endswith(">"):
        return "", formatted
    start = formatted.rfind("<")
    return _phrase(formatted[:start], "address"), formatted[start + 1:-1]


def _phrase(text: str, where: str) -> str:
    """The display name before ``<``: words and quoted strings, joined by single spaces."""
    words: list[str] = []
    for token in _PHRASE_TOKEN.finditer(text):
        quoted, word, special = token.groups()
        if quoted is not None:
            words.append(_QUOTED_PAIR.sub(r"\1", quoted))
        elif word is not None:
            words.append(word)
        elif special == '"':
            raise InvalidEmail(f"{where} has an unterminated quoted display name", field=where)
        elif special is not None and special in ",;<@":
            raise InvalidEmail(f"{where} holds more than one address: pass several recipients as a list", field=where)
        elif special is not None:
            raise InvalidEmail(f"{where} has {special!r} in its display name outside double quotes", field=where)
    return " ".join(words)


def _address(name: str, addr: str) -> Address:
    local, _, domain = addr.rpartition("@")
    return Address(display_name=name, username=local, domain=domain)


def _mime_address(formatted: str) -> Address:
    return _address(*split_address(formatted))


def _header_text(value: Any, where: str, *, tab: bool = False) -> str:
    if not isinstance(value, str):
        raise InvalidEmail(f"{where} must be a string, not {type(value).__name__}", field=where)
    bad = (_BAD_IN_TEXT if tab else _BAD_IN_FIELD).search(value)
    if bad:
        raise InvalidEmail(f"{where} contains U+{ord(bad.group()):04X}, a control character or line break "
                           "(header injection)", field=where)
    _refuse_invisible(value, where)
    if _has_encoded_word(value):
        raise InvalidEmail(f"{where} contains an RFC 2047 encoded word ('=?...?='), which the stdlib would decode "
                           "(header injection); give the text itself, non-ASCII is encoded for you", field=where)
    return value


def _refuse_invisible(value: str, where: str) -> None:
    flags: set[int] | None = None
    for found in _INVISIBLE.finditer(value):
        c, i = found.group(), found.start()
        if c == _ZWJ and 0 < i < len(value) - 1 and _pictographic(value[i - 1]) and _pictographic(value[i + 1]):
            continue  # an emoji sequence (a family, a profession): rendered as one picture, nothing hidden
        if c in "\u200c\u200d" and idna.valid_contextj(value, i):
            continue  # spelling where IDNA 2008 allows a joiner (RFC 5892 CONTEXTJ: Persian, Indic letter forms)
        if c >= "\U000e0000":
            if flags is None:
                flags = {j for m in _EMOJI_TAG_SEQUENCE.finditer(value) for j in range(m.start() + 1, m.end())}
            if i in flags:
                continue  # inside a flag's emoji tag sequence (England, Scotland, Wales)
        raise InvalidEmail(f"{where} contains U+{ord(c):04X}, an invisible or text-direction character "
                           "(it can make one text look like another)", field=where)


def _pictographic(c: str) -> bool:
    # Emoji are "So", skin tones "Sk"; U+FE0F (emoji presentation) may stand before the joiner.
    return c == "\ufe0f" or unicodedata.category(c) in ("So", "Sk")


def _scripts(label: str) -> set[str]:
    """The scripts of a label's letters, by the first word of their Unicode names (the stdlib has no Script)."""
    letters = ("Lu", "Ll", "Lt", "Lo")
    words = {unicodedata.name(c, "UNKNOWN").split(" ", 1)[0] for c in label if unicodedata.category(c) in letters}
    words.discard("KATAKANA-HIRAGANA")  # the prolonged sound mark: both kana
    return {"HAN" if word == "CJK" else word for word in words}


def _check_domain(addr: str, where: str) -> None:
    """Refuse a domain label that mixes scripts."""
    domain = addr.rpartition("@")[2]
    if domain.isascii():
        return
    for label in domain.split("."):
        scripts = _scripts(label)
        if len(scripts) > 1 and not any(scripts <= allowed for allowed in _SCRIPT_SETS):
            raise InvalidEmail(f"{where} has a domain label mixing scripts ({', '.join(sorted(scripts)).lower()}), "
                               "a look-alike of another domain (idemmail_allow_mixed_script_domains accepts it)",
                               field=where)


def _body(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidEmail(f"{where} must be a string, not {type(value).__name__}", field=where)
    bad = _BAD_IN_BODY.search(value)
    if bad:
        raise InvalidEmail(f"{where} contains U+{ord(bad.group()):04X}, which no email can carry", field=where)
    return value


def _attachments(value: Any) -> list[Any]:
    """The attachments given, at most :data:`MAX_ATTACHMENTS`."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise InvalidEmail("attachments must be a list", field="attachments")
    items = list(itertools.islice(value, MAX_ATTACHMENTS + 1))
    if len(items) > MAX_ATTACHMENTS:
        raise InvalidEmail(f"more than {MAX_ATTACHMENTS} attachments", field="attachments")
    return items


def _subject(value: Any) -> str:
    text = _header_text(value, "subject", tab=True)
    if len(text.encode("utf-8")) > MAX_SUBJECT_OCTETS:
        raise InvalidEmail(f"subject is over {MAX_SUBJECT_OCTETS} octets (RFC 5322 line limit)", field="subject")
    return text


def _listed(value: Any, where: str, limit: int) -> list[str]:
    """The addresses given for one field, each string one address; at most ``limit + 1`` taken."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip(" \t") else []  # an empty field is no address
    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise InvalidEmail(f"{where} must be an address or a list of addresses, not {type(value).__name__}",
                           field=where)
    items = list(itertools.islice(value, limit + 1))
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidEmail(f"{where}[{i}] must be a string, not {type(item).__name__}", field=where)
    return items


def _formatted(items: list[str], where: str, mixed_scripts: bool) -> tuple[str, ...]:
    out = []
    for i, item in enumerate(items):
        entry = where if len(items) == 1 else f"{where}[{i}]"
        try:
            name, addr = parse_address(item, entry)
            if not mixed_scripts:
                _check_domain(addr, entry)
        except InvalidEmail as exc:  # the message says which entry; the field stays "to"
            raise InvalidEmail(str(exc), field=where) from None
        out.append(str(_address(name, addr)) if name else addr)
    return tuple(out)


def _headers(value: Any) -> dict[str, str]:
    out = _mapping(value, "headers", MAX_HEADERS)
    seen: set[str] = set()
    for name, v in out.items():
        if not _FIELD_NAME.fullmatch(name):
            raise InvalidEmail(f"headers name {scrub(name)!r} is not a header name (printable ASCII except ':', "
                               "at most 76 characters)", field="headers")
        _header_text(name, "headers")
        lowered = name.lower()
        if lowered in RESERVED_HEADERS or lowered.startswith(_RESERVED_PREFIXES):
            raise InvalidEmail(f"headers: {name} is written by the library or the provider; set it through "
                               "its own argument, if it has one", field="headers")
        if lowered in seen:
            raise InvalidEmail(f"headers: {scrub(name)} is given twice (header names ignore case)", field="headers")
        seen.add(lowered)
        if len(v) > MAX_HEADER_VALUE_CHARS:  # before its text is scanned
            raise InvalidEmail(f"{_named('headers', name)} is over {MAX_HEADER_VALUE_CHARS} characters",
                               field=_named("headers", name))
        _header_text(v, _named("headers", name), tab=True)
    return out


def _tags(value: Any) -> dict[str, str]:
    out = _mapping(value, "tags", MAX_TAGS)
    for name, v in out.items():
        if len(name) > MAX_TAG_CHARS:  # before its text is looked at: the error quotes no part of it
            raise InvalidEmail(f"a tags name is over {MAX_TAG_CHARS} characters", field="tags")
        _header_text(name, "tags")
        if not name or ":" in name or any(c.isspace() for c in name):
            raise InvalidEmail(f"tags name {scrub(name)!r} is not valid (empty, white space or ':')", field="tags")
        if len(v) > MAX_TAG_CHARS:
            raise InvalidEmail(f"{_named('tags', name)} is over {MAX_TAG_CHARS} characters", field=_named("tags", name))
        _header_text(v, _named("tags", name))
    return out


def _named(where: str, name: str) -> str:
    """``where[name]`` for an error, the name scrubbed (errors reach the result backend and logs)."""
    return f"{where}[{scrub(name)}]"


def _mapping(value: Any, where: str, limit: int) -> dict[str, str]:
    """``value`` as a dict of strings, at most ``limit`` of them (counted before any is looked at)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidEmail(f"{where} must be a mapping", field=where)
    if len(value) > limit:
        raise InvalidEmail(f"more than {limit} {where}", field=where)
    for name, v in value.items():
        if not isinstance(name, str):
            raise InvalidEmail(f"{where} names must be strings, not {type(name).__name__}", field=where)
        if not isinstance(v, str):
            raise InvalidEmail(f"{_named(where, name)} must be a string, not {type(v).__name__}",
                               field=_named(where, name))
    return dict(value)
