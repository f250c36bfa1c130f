"""The ready-made ``send_email`` task: ``send_email.delay(to=..., subject=..., html=..., event_id=...)`` with
``idemmail_provider_url`` set (see docs/providers.md).

The intent (:func:`email_intent`) is who gets which event's email, never the body: the first attempt's body
ships. The message is validated at ``delay()`` (:class:`~idemmail_celery.errors.InvalidEmail`) and again at the
worker; provider errors leave without the message's addresses or subject.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from typing import Any

from celery import Celery, shared_task

from ._common import after_fork
from ._request import state_of
from .config import Settings
from .email import EmailMessage
from .encoding import canonical_json
from .errors import AmbiguousSendError, ConfigurationError, InvalidEmail, PermanentSendError, SendError
from .keys import Payload as _Payload
from .keys import normalize_addresses
from .providers import Provider
from .providers import from_url as provider_from_url
from .redaction import scrub, scrub_error
from .task import IdempotentTask

TASK_NAME = "idemmail_celery.send_email"

_RECIPIENTS = ("to", "cc", "bcc")
_providers: dict[tuple[str, str], Provider] = {}
_providers_lock = threading.Lock()


@after_fork
def _forget_providers() -> None:
    """A forked pool child builds its own providers: their connections are the parent's."""
    global _providers_lock
    _providers.clear()
    _providers_lock = threading.Lock()


def provider_url(settings: Settings) -> str:
    """``idemmail_provider_url``, or :class:`ConfigurationError` when it is not set."""
    url = settings.provider_url
    if not url:
        raise ConfigurationError("set idemmail_provider_url (resend://, https://..., smtp://..., file:///dir, console://)")
    return str(url)


def build_provider(settings: Settings) -> Provider:
    """The provider ``settings`` name (``idemmail_provider_url``, ``_api_key``, ``_timeout``), built once per process
    and credentials. Raises :class:`ConfigurationError` naming the setting and the scheme, never the key nor the URL."""
    url = provider_url(settings)
    api_key = settings.provider_api_key or None
    cache_key = (url, hashlib.sha256((api_key or "").encode()).hexdigest()[:12])
    with _providers_lock:
        provider = _providers.get(cache_key)
        if provider is None:
            options: dict[str, Any] = {"api_key": api_key}
            if settings.provider_timeout:
                options["timeout"] = float(settings.provider_timeout)
            try:
                provider = _providers[cache_key] = provider_from_url(url, **options)
            except ConfigurationError as exc:
                scheme = url.partition(":")[0][:20]
                raise ConfigurationError(f"idemmail_provider_url ({scheme}://...) cannot be used: {exc}") from None
        return provider


#: Arguments whose empty value (``""``, ``[]``, ``{}``) means the same as leaving them out.
_EMPTY_MEANS_NONE = frozenset({"subject", "reply_to", "headers", "tags", "attachments"})


def email_intent(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The intent of a ``send_email`` call (hashed by the caller): with an ``event_id``, event, template and
    recipients; without, all content. One call, one key, however it is spelled: recipients are normalised, an
    empty recipient field (``None``, ``""``, ``[]``) is no field, an integer ``event_id`` is its decimal string, an
    empty subject, reply_to, headers, tags or attachments is left out, a float holding an integer is that integer.
    Raises :class:`InvalidEmail` for an ``event_id`` or ``template`` of the wrong type."""
    fields: dict[str, Any] = {name: _recipient_field(kwargs.get(name)) for name in _RECIPIENTS}
    event_id = _event_id(kwargs.get("event_id"))
    if event_id is not None:
        fields.update(event_id=event_id, template=_template(kwargs.get("template")))
        return canonical_json({"by": "event", **fields})
    rest = {k: v for k, v in kwargs.items()
            if k not in _RECIPIENTS and v is not None and not (k in _EMPTY_MEANS_NONE and not v)}
    if "from_" in rest:
        rest["from_"] = normalize_addresses(rest["from_"])
    return canonical_json({"by": "content", **fields, **rest})


def _recipient_field(value: Any) -> Any:
    found = normalize_addresses(value)
    return None if found == [] else found


def _event_id(value: Any) -> str | None:
    """``event_id`` as the key holds it: a non-empty string (an int becomes its decimal string), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidEmail(f"event_id must be a str or an int, not {type(value).__name__}", field="event_id")
    text = str(value)
    if not text.strip():
        raise InvalidEmail("event_id is empty: leave it out to make the whole content the intent", field="event_id")
    return text


def _template(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidEmail(f"template must be a str, not {type(value).__name__}", field="template")
    return value


#: The arguments a message is built from (``message_from`` reads these and nothing else).
_MESSAGE_FIELDS = ("from_", "to", "subject", "text", "html", "cc", "bcc", "reply_to", "headers", "tags", "attachments")
#: The arguments stored with the message that are not part of it (they count towards its size budget).
_STORED_BESIDE = ("event_id", "template", "tenant")
#: What a call's arguments may hold beyond the message's size budget (argument names, attachment keys, addresses
#: longer as given than as stored): 64 KiB covers the most every bound allows, about 45 KB.
ARGUMENT_SLACK = 64 * 1024


class SendEmailTask(IdempotentTask):
    """The class behind ``send_email``: validates at ``delay()``, sends through the configured provider."""

    idempotency_key = staticmethod(email_intent)
    idempotency_tenant = "tenant"
    idempotency_redact_args = True  # Flower and task events show the key, not addresses and bodies

    def message_from(self, kwargs: dict[str, Any]) -> EmailMessage:
        """Build and validate the message a call describes (raises :class:`InvalidEmail`)."""
        settings = self.idem_settings
        # The body reuses what the check before the claim built (validating addresses is the costly part).
        fields = tuple(kwargs.get(name) for name in _MESSAGE_FIELDS)
        request = self.request
        state = state_of(request, create=False)
        held = state.message if state is not None else None
        if held is not None and held[1] is settings and held[0] == fields:
            return held[2]  # type: ignore[no-any-return]
        sender = kwargs.get("from_") or settings.default_from
        if not sender:
            raise InvalidEmail("no sender: pass from_= or set idemmail_default_from", field="from")
        # A sealed message was held to the budget in force when accepted: a budget lowered since must not drop it.
        budget = sys.maxsize if self.accepted_delivery() else int(settings.max_message_bytes)
        message = EmailMessage.build(
            sender=sender, to=kwargs.get("to") or (), subject=kwargs.get("subject", ""), text=kwargs.get("text"),
            html=kwargs.get("html"), cc=kwargs.get("cc"), bcc=kwargs.get("bcc"), reply_to=kwargs.get("reply_to"),
            headers=kwargs.get("headers"), tags=kwargs.get("tags"), attachments=kwargs.get("attachments"),
            max_bytes=budget, max_recipients=settings.max_recipients,
            allow_mixed_scripts=settings.allow_mixed_script_domains)
        # The budget counts every byte stored or sent: the call's other texts are stored with the message.
        size = message.size() + sum(len(v.encode("utf-8", "surrogatepass")) for v in (
            kwargs.get(name) for name in _STORED_BESIDE) if isinstance(v, str))
        if size > budget:
            raise InvalidEmail(f"the message is {size} bytes, over the limit of {budget} "
                               "(idemmail_max_message_bytes)", field="size")
        if not request.called_directly:  # a run's request, gone with the run (never the client's default)
            state_of(request).message = (fields, settings, message)  # type: ignore[union-attr]
        return message

    def max_argument_size(self) -> int:
        """The message size budget and :data:`ARGUMENT_SLACK`: a call :meth:`message_from` accepts always fits."""
        return int(self.idem_settings.max_message_bytes) + ARGUMENT_SLACK

    def check_call(self, args: Any, kwargs: dict[str, Any]) -> None:
        """The message must be valid and a provider configured before anything is accepted."""
        if args:
            raise TypeError("send_email takes keyword arguments only: send_email.delay(to=..., subject=...)")
        self.message_from(kwargs)
        _event_id(kwargs.get("event_id"))
        _template(kwargs.get("template"))
        self.provider_url()

    def check(self, payload: _Payload) -> None:
        """At the worker, before the claim: the message must be valid (:class:`InvalidEmail`) and the provider must
        build (:class:`ConfigurationError`: the message waits on the outage budget, nothing claimed)."""
        try:
            super().check(payload)
        except TypeError as exc:
            raise InvalidEmail(f"send_email arguments: {exc}", field="arguments") from exc
        self.provider  # noqa: B018 - built (and cached) now: a missing API key is not a "maybe sent"

    def provider_url(self) -> str:
        """``idemmail_provider_url``, or :class:`ConfigurationError` when it is not set."""
        return provider_url(self.idem_settings)

    _idem_provider: tuple[Any, Provider] | None = None  # (the settings it was built for, the provider)

    @property
    def provider(self) -> Provider:
        """This process's provider for ``idemmail_provider_url``, looked up once per task and settings."""
        settings = self.idem_settings
        held = self._idem_provider
        if held is not None and held[0] is settings:
            return held[1]
        self._idem_provider = (settings, build_provider(settings))
        return self._idem_provider[1]

    def deliver(self, kwargs: dict[str, Any], key: str) -> dict[str, Any]:
        """Build the message ``kwargs`` describe and send it once under ``key``. Raises :class:`PermanentSendError`
        (``invalid_email``) if it cannot be built, else what the provider raises, addresses and subject scrubbed."""
        try:
            message = self.message_from(kwargs)
        except InvalidEmail as exc:
            # from None: the error names the field and the rule, never the address; nothing more to chain.
            raise PermanentSendError(scrub(str(exc)), reason="invalid_email") from None
        try:
            result = self.provider.send(message, key=key)
        except SendError as exc:
            # The built-in providers scrub their own texts; a custom one may not.
            scrub_error(exc, message.personal_texts())
            raise
        except Exception as exc:
            # Anything else may have sent, and its text may quote the message: "maybe sent", scrubbed, cut off.
            text = scrub(f"{type(exc).__name__}: {exc}", message.personal_texts())
            raise AmbiguousSendError(text, reason="unexpected_error") from None
        return result.to_dict()

    def carries_key(self) -> bool:
        return self.provider.accepts_idempotency_key

    def writes_ahead(self) -> bool:
        # No provider yet raises here; the handler's writes_ahead() takes that as no promise made.
        return bool(self.provider.writes_ahead)

    def reconcile(self, key: str, payload: _Payload) -> Any | None:
        found = self.provider.find_sent(key)
        return None if found is None else {**found.to_dict(), "reconciled": True}


def _send_email(self: SendEmailTask, *, to: Any = None, subject: str = "", text: str | None = None,
                html: str | None = None, from_: str | None = None, cc: Any = None, bcc: Any = None,
                reply_to: Any = None, headers: dict[str, str] | None = None, tags: dict[str, str] | None = None,
                attachments: list[dict[str, str]] | None = None, event_id: str | None = None,
                template: str | None = None, tenant: str | None = None) -> dict[str, Any]:
    """Send one email, once per intent. Returns the provider's message id and name."""
    return self.deliver({
        "to": to, "subject": subject, "text": text, "html": html, "from_": from_, "cc": cc, "bcc": bcc,
        "reply_to": reply_to, "headers": headers, "tags": tags, "attachments": attachments,
    }, self.request.idempotency_key)


send_email: SendEmailTask = shared_task(base=SendEmailTask, bind=True, name=TASK_NAME)(_send_email)


def register(app: Celery) -> SendEmailTask:
    """Register ``send_email`` on ``app`` explicitly and return the bound task."""
    task: SendEmailTask = app.task(base=SendEmailTask, bind=True, name=TASK_NAME)(_send_email)
    return task
