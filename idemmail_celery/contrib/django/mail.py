"""Django's email API over ``send_email`` (``EMAIL_BACKEND = "idemmail_celery.contrib.django.EmailBackend"``,
docs/django.md): one Django message is one ``send_email`` call, its intent the ``Idempotency-Key`` header, else
a digest of the message and its slot of the clock. In the backend's database's open transaction the call is an
outbox row; in autocommit it is published on the connection :meth:`EmailBackend.open` holds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Sequence
from email.mime.base import MIMEBase
from typing import Any

from celery import Task
from django.conf import global_settings, settings
from django.core.mail.backends.base import BaseEmailBackend
from django.core.mail.message import EmailMessage
from django.db import DEFAULT_DB_ALIAS, connections
from kombu.exceptions import OperationalError as KombuOperationalError

from ...errors import ConfigurationError, InvalidEmail
from ...mail import TASK_NAME
from .conf import celery_app
from .outbox import enqueue

__all__ = ["IDEMPOTENCY_HEADER", "EmailBackend", "intent_of"]

IDEMPOTENCY_HEADER = "Idempotency-Key"  # names a message's intent itself; never sent
#: What a broker that does not answer raises from a publish: what ``fail_silently`` swallows.
_SEND_ERRORS = (OSError, KombuOperationalError)


class EmailBackend(BaseEmailBackend):
    """Django's email backend over ``send_email`` on the project's Celery app. Options (a mailer's ``OPTIONS``,
    or ``get_connection(path, **options)``): ``fail_silently``; ``using``, the database whose open transaction an
    email joins; ``window``, seconds, for ``idemmail_email_window_seconds``."""

    def __init__(self, fail_silently: bool = False, *, using: str | None = None, window: float | None = None,
                 **kwargs: Any) -> None:
        # fail_silently is kept here: Django 6.1's base class deprecates taking it; ``alias`` (MAILERS) goes up.
        super().__init__(**kwargs)
        self.fail_silently = fail_silently
        if window is not None and (isinstance(window, bool) or not isinstance(window, (int, float)) or window <= 0):
            raise ConfigurationError(f"window must be a positive number of seconds, not {window!r}")
        self.using = using or DEFAULT_DB_ALIAS
        self.window = window
        self._producer: Any = None
        self._lock = threading.RLock()

    @property
    def task(self) -> Task:  # send_email on the project's Celery app
        return celery_app().tasks[TASK_NAME]

    def open(self) -> bool:
        """Take a broker connection for the messages sent until :meth:`close`; False if one is held already."""
        if self._producer is not None:
            return False
        self._producer = self.task.app.producer_pool.acquire(block=True)
        return True

    def close(self) -> None:  # the broker connection back to the app's pool
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.release()

    def send_messages(self, email_messages: Sequence[EmailMessage]) -> int:
        """Send each message once per intent; the number sent (enqueued, or written to the outbox). A message the
        library refuses raises :class:`~idemmail_celery.errors.InvalidEmail` (``IdempotencyKeyError`` for an empty
        or overlong ``Idempotency-Key``) before any message of the batch is written or published."""
        if not email_messages:
            return 0
        task = self.task
        window = self.window or task.idem_settings.email_window_seconds
        # One without recipients is skipped, as Django's SMTP backend does; every other one is checked
        # before any is sent, so a refused message leaves the batch unsent, not half sent.
        calls = [intent_of(m, window) for m in email_messages if m.recipients()]
        for call, key in calls:
            task.intent_headers((), call, explicit=key)  # the message and its key, as apply_async checks them
        with self._lock:
            atomic = connections[self.using].in_atomic_block
            opened = False if atomic else self.open()
            try:
                return sum(self._send(task, call, key, atomic) for call, key in calls)
            finally:
                if opened:
                    self.close()

    def _send(self, task: Task, call: dict[str, Any], key: str, atomic: bool) -> int:
        if atomic:  # the row commits or rolls back with the caller's data; the relay publishes it
            enqueue(task, (), call, using=self.using, nudge=True, idempotency_key=key)
            return 1
        try:
            task.apply_async(kwargs=call, idempotency_key=key, producer=self._producer)
        except _SEND_ERRORS:
            if not self.fail_silently:
                raise
            return 0
        return 1


def intent_of(message: EmailMessage, window: float, now: float | None = None) -> tuple[dict[str, Any], str]:
    """``message`` as ``send_email`` keywords, and its intent: the ``Idempotency-Key`` header, else the message
    within its ``window``-second slot of the clock (``now``, default the time). Raises
    :class:`~idemmail_celery.errors.InvalidEmail` for what ``send_email`` cannot carry: an alternative other than
    one HTML part, a ``multipart/related`` message, an attachment given as a MIME part or without a file name."""
    headers = {str(name): str(value) for name, value in message.extra_headers.items()}
    explicit = next((headers.pop(n) for n in list(headers) if n.lower() == IDEMPOTENCY_HEADER.lower()), None)
    body = message.body or None  # an HTML-only EmailMultiAlternatives has an empty body
    text, html = (None, body) if message.content_subtype == "html" else (body, None)
    for content, mimetype in getattr(message, "alternatives", None) or ():
        if mimetype == "text/html" and html is None:
            html = str(content)
        else:
            raise InvalidEmail(f"send_email carries a text body and one HTML alternative, not a {mimetype} "
                               "alternative", field="alternatives")
    # Django before 6.0 lets a subclass set ``mixed_subtype``; 6.0 removed it (and refuses a message that sets it).
    mixed = getattr(message, "mixed_subtype", "mixed")
    if mixed != "mixed":
        raise InvalidEmail(f"send_email sends attachments as multipart/mixed, not multipart/{mixed}",
                           field="attachments")
    call: dict[str, Any] = {
        "from_": _sender(message.from_email), "to": list(message.to), "cc": list(message.cc), "bcc": list(message.bcc),
        "reply_to": list(message.reply_to), "subject": str(message.subject), "text": text, "html": html,
        "headers": headers, "attachments": [_attachment(a) for a in message.attachments]}
    if explicit is None:
        fields = {k: call[k] for k in ("from_", "to", "cc", "bcc", "reply_to", "subject", "text", "html")}
        # Each file by its own digest: JSON-encoding megabytes of base64 again would cost more than hashing them.
        fields["attachments"] = [{**a, "content_b64": hashlib.sha256(a["content_b64"].encode()).hexdigest()}
                                 for a in call["attachments"]]
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
        slot = int((time.time() if now is None else now) // window)
        explicit = f"django-email:{window:g}:{slot}:{digest}"
    return {name: value for name, value in call.items() if value or name in ("to", "subject")}, explicit


def _sender(address: str) -> str | None:
    """The message's sender; None (``idemmail_default_from``) for Django's placeholder, an unset
    ``DEFAULT_FROM_EMAIL`` (``webmaster@localhost``, which no provider accepts)."""
    return None if address == global_settings.DEFAULT_FROM_EMAIL == settings.DEFAULT_FROM_EMAIL else address


def _attachment(attachment: Any) -> dict[str, str]:
    if isinstance(attachment, MIMEBase):
        raise InvalidEmail("an attachment given as a MIME part cannot be carried: attach(filename, content, "
                           "mimetype) instead", field="attachments")
    filename, content, mimetype = attachment
    if not filename:
        raise InvalidEmail("an attachment has no file name", field="attachments.filename")
    data = content.encode() if isinstance(content, str) else bytes(content)
    return {"filename": str(filename), "content_type": str(mimetype or "application/octet-stream"),
            "content_b64": base64.b64encode(data).decode("ascii")}
