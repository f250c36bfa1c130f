"""The ready-made ``send_email`` task.

::

    from idemmail_celery import send_email

    app.conf.idemmail_provider_url = "resend://"          # or https://..., smtp://..., file:///...
    app.conf.idemmail_provider_api_key = os.environ["RESEND_API_KEY"]
    app.conf.idemmail_default_from = "Shop <shop@example.com>"

    send_email.delay(to="ann@example.com", subject="Your receipt", html="<p>Thanks</p>",
                     event_id="order_4821", template="receipt")

**The intent** is who gets which event's email: ``tenant``, ``event_id`` (the
business event that caused the send), ``template``, the recipients (to, cc,
bcc, normalised) and the task's version, never the body text. A retry whose
body was regenerated (an agent rewrote it) is the same intent, and the body
of the *first* attempt is the one that ships. Without an ``event_id`` the
whole content is the intent: two calls are the same intent only if every
field matches.

The message is validated at ``delay()`` (:class:`~idemmail_celery.errors.InvalidEmail`,
nothing enqueued). One that reaches a worker anyway (``send_task`` by name)
ends as ``failed`` with reason ``invalid_email``, never retried.

``send_email`` is a Celery shared task: it registers itself on every app once
``idemmail_celery`` is imported (import it in the module that defines your app),
or call :func:`register` explicitly.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

from celery import Celery, shared_task

from .email import DEFAULT_MAX_BYTES, EmailMessage
from .errors import ConfigurationError, InvalidEmail, PermanentSendError
from .keys import Payload as _Payload
from .keys import canonical_json, normalize_addresses
from .providers import Provider
from .providers import from_url as provider_from_url
from .task import IdempotentTask

TASK_NAME = "idemmail_celery.send_email"

_RECIPIENTS = ("to", "cc", "bcc")
_providers: dict[tuple[int, str, str], Provider] = {}
_providers_lock = threading.Lock()


def email_intent(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The intent of a ``send_email`` call (namespaced and hashed by the caller).

    With an ``event_id``: event, template and recipients. Without: all content.
    """
    fields: dict[str, Any] = {name: normalize_addresses(kwargs.get(name)) for name in _RECIPIENTS}
    if kwargs.get("event_id") is not None:
        fields.update(event_id=kwargs["event_id"], template=kwargs.get("template"))
        return canonical_json({"by": "event", **fields})
    rest = {k: v for k, v in kwargs.items() if k not in _RECIPIENTS and v is not None}
    if "from_" in rest:
        rest["from_"] = normalize_addresses(rest["from_"])
    return canonical_json({"by": "content", **fields, **rest})


class SendEmailTask(IdempotentTask):
    """The class behind ``send_email``: validates at ``delay()``, sends through the configured provider."""

    idempotency_key = staticmethod(email_intent)
    idempotency_tenant = "tenant"
    idempotency_redact_args = True  # Flower and task events show the key, not addresses and bodies

    def message_from(self, kwargs: dict[str, Any]) -> EmailMessage:
        """Build and validate the message a call describes (raises :class:`InvalidEmail`)."""
        conf = self.app.conf
        sender = kwargs.get("from_") or conf.get("idemmail_default_from")
        if not sender:
            raise InvalidEmail("no sender: pass from_= or set idemmail_default_from", field="from")
        return EmailMessage.build(
            sender=sender, to=kwargs.get("to") or (), subject=kwargs.get("subject", ""),
            text=kwargs.get("text"), html=kwargs.get("html"), cc=kwargs.get("cc"), bcc=kwargs.get("bcc"),
            reply_to=kwargs.get("reply_to"), headers=kwargs.get("headers"), tags=kwargs.get("tags"),
            attachments=kwargs.get("attachments"),
            max_bytes=int(conf.get("idemmail_max_message_bytes") or DEFAULT_MAX_BYTES),
        )

    def check_call(self, args: Any, kwargs: dict[str, Any]) -> None:
        """The message must be valid and a provider configured before anything is accepted."""
        if args:
            raise TypeError("send_email takes keyword arguments only: send_email.delay(to=..., subject=...)")
        self.message_from(kwargs)
        self.provider_url()

    def provider_url(self) -> str:
        url = self.app.conf.get("idemmail_provider_url")
        if not url:
            raise ConfigurationError(
                "set idemmail_provider_url (resend://, https://..., smtp://..., file:///dir, console://)"
            )
        return str(url)

    @property
    def provider(self) -> Provider:
        """This process's provider for ``idemmail_provider_url`` (the API key from settings or env)."""
        url = self.provider_url()
        api_key = self.app.conf.get("idemmail_provider_api_key") or None
        timeout = self.app.conf.get("idemmail_provider_timeout")
        # The cache key holds a digest of the API key, never the key itself.
        secret_id = hashlib.sha256((api_key or "").encode()).hexdigest()[:12]
        cache_key = (os.getpid(), url, secret_id)
        with _providers_lock:
            provider = _providers.get(cache_key)
            if provider is None:
                options: dict[str, Any] = {"api_key": api_key}
                if timeout:
                    options["timeout"] = float(timeout)
                provider = _providers[cache_key] = provider_from_url(url, **options)
            return provider

    def carries_key(self) -> bool:
        return self.provider.accepts_idempotency_key

    def reconcile(self, key: str, payload: _Payload) -> Any | None:
        found = self.provider.find_sent(key)
        return None if found is None else {**found.to_dict(), "reconciled": True}


def _send_email(
    self: SendEmailTask,
    *,
    to: Any = None,
    subject: str = "",
    text: str | None = None,
    html: str | None = None,
    from_: str | None = None,
    cc: Any = None,
    bcc: Any = None,
    reply_to: Any = None,
    headers: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
    attachments: list[dict[str, str]] | None = None,
    event_id: str | None = None,
    template: str | None = None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """Send one email, once per intent. Returns the provider's message id and name."""
    try:
        message = self.message_from({
            "to": to, "subject": subject, "text": text, "html": html, "from_": from_, "cc": cc, "bcc": bcc,
            "reply_to": reply_to, "headers": headers, "tags": tags, "attachments": attachments,
        })
    except InvalidEmail as exc:
        raise PermanentSendError(str(exc), reason="invalid_email") from exc
    result = self.provider.send(message, key=self.request.idempotency_key)
    return result.to_dict()


send_email: SendEmailTask = shared_task(base=SendEmailTask, bind=True, name=TASK_NAME)(_send_email)


def register(app: Celery) -> SendEmailTask:
    """Register ``send_email`` on ``app`` explicitly and return the bound task."""
    task: SendEmailTask = app.task(base=SendEmailTask, bind=True, name=TASK_NAME)(_send_email)
    return task
