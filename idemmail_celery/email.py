"""The email message: a typed value, checked before anything is enqueued.

:class:`EmailMessage` is what ``send_email`` carries and every provider sends.
:meth:`EmailMessage.build` validates (addresses with ``email-validator``, syntax
only, no DNS; CR/LF in any header field; no recipient; no body; size) and raises
:class:`~idemmail_celery.errors.InvalidEmail` naming the problem. The JSON form
(:meth:`to_payload`/:meth:`from_payload`) is what travels in the task message
and is stored as the first payload. :meth:`to_mime` builds the RFC 5322 message
with the stdlib ``email`` package, deterministically: the same message and key
give the same bytes, so a retry is byte-identical.
"""

from __future__ import annotations

import base64
import email.policy
import email.utils
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from email.headerregistry import Address
from email.message import EmailMessage as MIMEMessage
from typing import Any

from email_validator import EmailNotValidError, validate_email

from .errors import InvalidEmail

DEFAULT_MAX_BYTES = 10 * 1024 * 1024
_FORBIDDEN = ("\r", "\n", "\0")


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
    """One email. Build it with :meth:`build`, which validates; the fields are then trusted."""

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
        cls,
        *,
        sender: str,
        to: str | Iterable[str],
        subject: str,
        text: str | None = None,
        html: str | None = None,
        cc: str | Iterable[str] | None = None,
        bcc: str | Iterable[str] | None = None,
        reply_to: str | Iterable[str] | None = None,
        headers: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
        attachments: Iterable[Attachment | Mapping[str, Any]] | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> EmailMessage:
        """A validated message, or :class:`InvalidEmail` saying which field is wrong and why."""
        message = cls(
            sender=_one_address(sender, "from"),
            to=_addresses(to, "to"),
            subject=_header_text(subject, "subject"),
            text=_body(text, "text"),
            html=_body(html, "html"),
            cc=_addresses(cc, "cc"),
            bcc=_addresses(bcc, "bcc"),
            reply_to=_addresses(reply_to, "reply_to"),
            headers=_header_map(headers, "headers"),
            tags=_header_map(tags, "tags"),
            attachments=tuple(
                a if isinstance(a, Attachment) else Attachment.from_payload(a) for a in (attachments or ())
            ),
        )
        if not (message.to or message.cc or message.bcc):
            raise InvalidEmail("the message has no recipient", field="to")
        if message.text is None and message.html is None:
            raise InvalidEmail("the message has neither text nor html", field="text")
        for a in message.attachments:
            _header_text(a.filename, "attachments.filename")
            _header_text(a.content_type, "attachments.content_type")
        size = message.size()
        if size > max_bytes:
            raise InvalidEmail(f"the message is {size} bytes, over the limit of {max_bytes}", field="size")
        return message

    # -- wire forms --

    def to_payload(self) -> dict[str, Any]:
        """The JSON form that travels in the task message and is stored as the first payload."""
        return {
            "from": self.sender, "to": list(self.to), "cc": list(self.cc), "bcc": list(self.bcc),
            "reply_to": list(self.reply_to), "subject": self.subject, "text": self.text, "html": self.html,
            "headers": dict(self.headers), "tags": dict(self.tags),
            "attachments": [a.to_payload() for a in self.attachments],
        }

    @classmethod
    def from_payload(cls, data: Mapping[str, Any], *, max_bytes: int = DEFAULT_MAX_BYTES) -> EmailMessage:
        """Rebuild (and re-validate) a message from :meth:`to_payload` output."""
        return cls.build(
            sender=data.get("from", ""), to=data.get("to") or (), subject=data.get("subject", ""),
            text=data.get("text"), html=data.get("html"), cc=data.get("cc"), bcc=data.get("bcc"),
            reply_to=data.get("reply_to"), headers=data.get("headers"), tags=data.get("tags"),
            attachments=data.get("attachments"), max_bytes=max_bytes,
        )

    def recipients(self) -> tuple[str, ...]:
        """Every envelope recipient: to, cc and bcc, addresses only."""
        return tuple(email.utils.parseaddr(a)[1] for a in (*self.to, *self.cc, *self.bcc))

    def size(self) -> int:
        """Approximate size on the wire: bodies, headers and attachments (base64)."""
        parts = [self.subject, self.text or "", self.html or "", *self.to, *self.cc, *self.bcc,
                 *self.reply_to, *self.headers.keys(), *self.headers.values()]
        return sum(len(p.encode("utf-8")) for p in parts) + sum(len(a.content) * 4 // 3 for a in self.attachments)

    def to_mime(self, *, message_id: str | None = None, date: str | None = None) -> MIMEMessage:
        """The RFC 5322 message. No random boundary, no implicit Date: the same input gives the same bytes.

        ``message_id`` (e.g. from :func:`message_id_for`) and ``date`` are set when given.
        Bcc is never written into the headers; pass :meth:`recipients` as the envelope.
        """
        msg = MIMEMessage(policy=email.policy.SMTP)
        msg["From"] = self.sender
        msg["To"] = ", ".join(self.to)
        if self.cc:
            msg["Cc"] = ", ".join(self.cc)
        if self.reply_to:
            msg["Reply-To"] = ", ".join(self.reply_to)
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
        _fix_boundaries(msg, seed=hashlib.sha256(repr(self.to_payload()).encode()).hexdigest()[:24])
        return msg


def message_id_for(key: str, domain: str) -> str:
    """A Message-ID derived from the intent key: ``<key@domain>`` (the key is already a hash)."""
    return f"<{key}@{domain}>"


def _fix_boundaries(msg: MIMEMessage, seed: str) -> None:
    # The stdlib picks random MIME boundaries; derive them from the content instead.
    for n, part in enumerate(msg.walk()):
        if part.is_multipart():
            part.set_boundary(f"=_idemmail_{seed}_{n}")


def _check_text(value: str, where: str) -> str:
    if any(c in value for c in _FORBIDDEN):
        raise InvalidEmail(f"{where} contains a line break or NUL (header injection)", field=where)
    return value


def _header_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidEmail(f"{where} must be a string, not {type(value).__name__}", field=where)
    return _check_text(value, where)


def _body(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidEmail(f"{where} must be a string, not {type(value).__name__}", field=where)
    return value


def _header_map(value: Mapping[str, Any] | None, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidEmail(f"{where} must be a mapping", field=where)
    out: dict[str, str] = {}
    for name, v in value.items():
        _header_text(name, f"{where} name")
        if not name or ":" in name or " " in name:
            raise InvalidEmail(f"{where} name {name!r} is not a valid header name", field=where)
        out[name] = _header_text(v, f"{where}[{name}]")
    return out


def _one_address(value: Any, where: str) -> str:
    text = _header_text(value, where).strip()
    if not text:
        raise InvalidEmail(f"{where} is empty", field=where)
    name, addr = email.utils.parseaddr(text)
    if not addr or "@" not in addr:
        raise InvalidEmail(f"{where} is not an email address", field=where)
    try:
        checked = validate_email(addr, check_deliverability=False)
    except EmailNotValidError as exc:
        raise InvalidEmail(f"{where} is not a valid address: {exc}", field=where) from exc
    normalized = str(checked.normalized)
    # headerregistry quotes display names and copes with non-ASCII; formataddr does not.
    return _display(name, normalized) if name else normalized


def _addresses(value: str | Iterable[str] | None, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        _header_text(item, where)
        for part in _split(item):
            out.append(_one_address(part, where))
    return tuple(out)


def _split(text: str) -> list[str]:
    return [_display(name, addr) if name else addr
            for name, addr in email.utils.getaddresses([text]) if addr] or [text]


def _display(name: str, addr: str) -> str:
    local, _, domain = addr.rpartition("@")
    return str(Address(display_name=name, username=local, domain=domain))
