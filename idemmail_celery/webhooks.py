"""Provider webhooks: evidence from outside that an intent went out, recorded in the ledger.

Postmark, SendGrid and SES de-duplicate nothing, so an ambiguous send is parked
in ``review`` (see :mod:`idemmail_celery.providers.postmark`). Their delivery
events settle it: every message is tagged with its intent key, the provider
echoes the tag in its events, and :func:`reconcile` calls
:meth:`Ledger.confirm_sent <idemmail_celery.ledger.base.Ledger.confirm_sent>`,
which moves ``review`` (or ``claimed``, ``released``, ``failed``) to ``sent``
with the provider's message id. A ``sent`` record stays as it is, so a
redelivered event is harmless.

=========  ========================================================  ==========================================
provider   events that confirm a send                                where the key and the message id are
=========  ========================================================  ==========================================
postmark   ``RecordType: "Delivery"``                                ``Metadata.idemmail_key``, ``MessageID``
sendgrid   ``event: "processed"`` or ``"delivered"`` (a JSON list)   ``idemmail_key`` (custom args are top-level),
                                                                     ``sg_message_id``
ses        ``eventType`` (or ``notificationType``) ``"Send"`` or     ``mail.tags.idemmail_key[0]``,
           ``"Delivery"``, bare or inside an SNS ``Notification``    ``mail.messageId``
=========  ========================================================  ==========================================

Other events (bounces, opens, ...) and events without the key return None.

**Who may post.** :func:`handle_webhook` and :func:`webhook_app` refuse anything
not authenticated with the shared ``secret``, raising
:class:`WebhookSignatureError` (HTTP 401). What each provider can actually offer:

* **Postmark** signs nothing. Its webhooks can carry HTTP basic auth (credentials
  in the webhook URL, ``https://user:password@host/path``, or the webhook's
  ``HttpAuth``) and custom headers (``HttpHeaders``). Accepted: ``Authorization:
  Basic`` matching ``secret="user:password"``, or the header
  ``X-Idemmail-Webhook-Secret: <secret>``. Both are a shared secret sent with
  every request: use HTTPS; there is no body integrity beyond TLS and no replay
  window (a replayed delivery event only re-confirms the truth).
* **SendGrid** signs its Event Webhook with ECDSA (P-256, SHA-256 over timestamp +
  body, headers ``X-Twilio-Email-Event-Webhook-Signature``/``-Timestamp``).
  Verifying that needs an elliptic-curve library, which this package does not
  depend on, so it is **not verified here**. Accepted instead: the HMAC scheme
  below, from a relay (an API gateway, a function) that verified SendGrid's
  signature and forwards the body unchanged. A request straight from SendGrid is
  refused (fail closed).
* **SES** publishes events through SNS, which signs messages with RSA and an
  X.509 certificate fetched from ``SigningCertURL``; that is **not verified
  here** either (no network fetches, no X.509 parser in the standard library).
  SNS HTTPS subscriptions support basic auth in the endpoint URL
  (``https://user:password@host/path``; SNS first expects a 401 challenge, which
  the WSGI app sends), so accepted are ``Authorization: Basic`` matching
  ``secret="user:password"``, or the HMAC scheme from a verifying relay.
  Subscription confirmations are logged with their ``SubscribeURL`` for an
  operator to confirm; nothing is fetched.

**The HMAC scheme** (``hmac-sha256-v1``): headers ``X-Idemmail-Timestamp: <unix
seconds>`` and ``X-Idemmail-Signature: v1=<hex HMAC-SHA256(secret, timestamp + "." +
raw body)>``, with the timestamp within ``tolerance`` (300 s) of now.
:func:`hmac_headers` makes them. ``secret`` may be a list, to rotate secrets.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigurationError, IdemmailError, LedgerError, RecordNotFoundError
from .ledger.base import Ledger, Record
from .providers.postmark import KEY_TAG

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

__all__ = [
    "PROVIDERS", "SECRET_HEADER", "SIGNATURE_HEADER", "TIMESTAMP_HEADER", "DeliveryEvidence", "WebhookOutcome",
    "WebhookPayloadError", "WebhookSignatureError", "evidence", "handle_webhook", "hmac_headers", "reconcile",
    "verify", "webhook_app",
]

logger = logging.getLogger(__name__)

PROVIDERS = ("postmark", "sendgrid", "ses")
SIGNATURE_HEADER = "X-Idemmail-Signature"
TIMESTAMP_HEADER = "X-Idemmail-Timestamp"
SECRET_HEADER = "X-Idemmail-Webhook-Secret"
DEFAULT_TOLERANCE = 300.0
DEFAULT_MAX_BODY = 1024 * 1024

#: How each provider may authenticate its requests (see the module docstring).
SCHEMES: Mapping[str, tuple[str, ...]] = {
    "postmark": ("basic", "header"),
    "sendgrid": ("hmac",),
    "ses": ("basic", "hmac"),
}
_CONFIRMING = {"postmark": ("Delivery",), "sendgrid": ("processed", "delivered"), "ses": ("Send", "Delivery")}


class WebhookSignatureError(IdemmailError):
    """The webhook request is not authenticated (no credentials, wrong ones, a stale timestamp).

    Nothing was read from it and the ledger is unchanged. Answer 401.
    """


class WebhookPayloadError(IdemmailError, ValueError):
    """The authenticated webhook body is not what the provider sends (not JSON, wrong shape). Answer 400."""


@dataclass(frozen=True)
class DeliveryEvidence:
    """What one provider event proves: the message ``message_id`` for intent ``key`` left the provider."""

    provider: str
    key: str
    message_id: str
    event: str


@dataclass(frozen=True)
class WebhookOutcome:
    """What one webhook request did: records now ``sent``, keys the ledger does not know, events ignored."""

    confirmed: list[Record] = field(default_factory=list)
    unknown_keys: list[str] = field(default_factory=list)
    ignored: int = 0


# -- reading events --


def _provider_of(event: Mapping[str, Any]) -> str | None:
    if "RecordType" in event:
        return "postmark"
    if "sg_message_id" in event or ("event" in event and "email" in event):
        return "sendgrid"
    if "mail" in event or event.get("Type") in ("Notification", "SubscriptionConfirmation"):
        return "ses"
    return None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _unwrap_sns(event: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The SES event inside an SNS Notification envelope (or the event itself when not wrapped)."""
    if event.get("Type") == "SubscriptionConfirmation":
        return None
    if event.get("Type") == "Notification":
        try:
            inner = json.loads(str(event.get("Message", "")))
        except ValueError:
            raise WebhookPayloadError("the SNS notification's Message is not JSON") from None
        return inner if isinstance(inner, Mapping) else None
    return event


def evidence(event: Mapping[str, Any], *, provider: str | None = None) -> DeliveryEvidence | None:
    """What a parsed, verified provider event proves, or None (not a confirming event, or no key).

    The provider is recognised from the event's shape; ``provider`` insists on one
    (:class:`WebhookPayloadError` if the event is another's).
    """
    found = _provider_of(event)
    if provider is not None and found is not None and found != provider:
        raise WebhookPayloadError(f"a {found} event posted to the {provider} webhook")
    key = message_id = kind = None
    if found == "postmark":
        kind = _text(event.get("RecordType"))
        metadata = event.get("Metadata")
        key = _text(metadata.get(KEY_TAG)) if isinstance(metadata, Mapping) else None
        message_id = _text(event.get("MessageID"))
    elif found == "sendgrid":
        kind = _text(event.get("event"))
        key = _text(event.get(KEY_TAG))
        message_id = _text(event.get("sg_message_id"))
    elif found == "ses":
        inner = _unwrap_sns(event)
        mail = inner.get("mail") if inner is not None else None
        if inner is None or not isinstance(mail, Mapping):
            return None
        kind = _text(inner.get("eventType")) or _text(inner.get("notificationType"))
        tags = mail.get("tags")
        values = tags.get(KEY_TAG) if isinstance(tags, Mapping) else None
        key = _text(values[0]) if isinstance(values, list) and values else None
        message_id = _text(mail.get("messageId"))
    if found is None or kind not in _CONFIRMING[found] or key is None or message_id is None:
        return None
    return DeliveryEvidence(found, key, message_id, kind)


def reconcile(event: Mapping[str, Any], *, ledger: Ledger, provider: str | None = None) -> Record | None:
    """Record a parsed, **already verified** provider event in ``ledger``; the record, or None if it proves nothing.

    A confirming event moves the intent's record to ``sent`` with
    ``{"message_id", "provider", "via": "webhook"}`` (a ``sent`` record is returned
    unchanged). Raises :class:`RecordNotFoundError` when the ledger has no record
    for the key (expired past retention, another ledger, or never claimed), and
    :class:`WebhookPayloadError` for an event of another provider than ``provider``.
    """
    found = evidence(event, provider=provider)
    if found is None:
        return None
    result = {"message_id": found.message_id, "provider": found.provider, "via": "webhook"}
    try:
        record = ledger.confirm_sent(found.key, result, note=f"{found.provider} {found.event} webhook",
                                     actor=f"webhook:{found.provider}")
    except RecordNotFoundError:
        raise RecordNotFoundError(
            f"{found.provider} reports {found.event} of message {found.message_id} for key {found.key}, "
            "but the ledger has no record of it (expired past retention, another ledger, or never claimed)"
        ) from None
    logger.info("idemmail: %s confirmed by %s %s webhook (message %s)", found.key, found.provider, found.event,
                found.message_id)
    return record


# -- authenticating requests --


def _secrets(secret: str | Sequence[str]) -> list[bytes]:
    values = [secret] if isinstance(secret, str) else list(secret)
    if not values or not all(isinstance(s, str) and s for s in values):
        raise ConfigurationError("a webhook secret must be a non-empty string (or a list of them, to rotate)")
    return [s.encode("utf-8") for s in values]


def _signature(secret: bytes, timestamp: str, body: bytes) -> str:
    return hmac.new(secret, timestamp.encode("ascii") + b"." + body, hashlib.sha256).hexdigest()


def hmac_headers(body: bytes, secret: str, *, timestamp: int | None = None) -> dict[str, str]:
    """The headers that authenticate ``body`` under the HMAC scheme (for relays and tests)."""
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    return {TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: f"v1={_signature(secret.encode('utf-8'), stamp, body)}"}


def _any_equal(presented: bytes, secrets: list[bytes]) -> bool:
    # Compare with every secret, never stopping early: the time taken says nothing about which matched.
    return sum(hmac.compare_digest(presented, s) for s in secrets) > 0


def verify(
    provider: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    secret: str | Sequence[str],
    now: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> str:
    """Check that a webhook request comes from whoever holds ``secret``; the scheme that matched.

    ``headers`` are the request's (any case), ``body`` its raw bytes. The schemes
    ``provider`` may use are in :data:`SCHEMES`. Raises :class:`WebhookSignatureError`
    when none is presented, or the one presented does not match.
    """
    if provider not in SCHEMES:
        raise ConfigurationError(f"no webhook support for {provider!r} (known: {', '.join(PROVIDERS)})")
    keys = _secrets(secret)
    lowered = {name.lower(): value for name, value in headers.items()}
    schemes = SCHEMES[provider]
    authorization = lowered.get("authorization", "")
    if "basic" in schemes and authorization[:6].lower() == "basic ":
        try:
            presented = base64.b64decode(authorization[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            raise WebhookSignatureError("the basic auth credentials are malformed") from None
        if not _any_equal(presented, keys):
            raise WebhookSignatureError("the basic auth credentials do not match")
        return "basic"
    if "header" in schemes and SECRET_HEADER.lower() in lowered:
        if not _any_equal(lowered[SECRET_HEADER.lower()].encode("utf-8"), keys):
            raise WebhookSignatureError(f"the {SECRET_HEADER} header does not match")
        return "header"
    if "hmac" in schemes and SIGNATURE_HEADER.lower() in lowered:
        stamp = lowered.get(TIMESTAMP_HEADER.lower(), "")
        if not stamp.isdigit():
            raise WebhookSignatureError(f"the signature needs a {TIMESTAMP_HEADER} header in unix seconds")
        if abs((time.time() if now is None else now) - int(stamp)) > tolerance:
            raise WebhookSignatureError(f"the signature's timestamp is more than {tolerance:.0f} s from now")
        offered = [part.strip()[3:].encode("ascii", "replace") for part in lowered[SIGNATURE_HEADER.lower()].split(",")
                   if part.strip().startswith("v1=")]
        expected = [_signature(k, stamp, body).encode("ascii") for k in keys]
        if not any(_any_equal(o, expected) for o in offered):
            raise WebhookSignatureError("the signature does not match the body")
        return "hmac"
    wanted = {"basic": "Authorization: Basic", "header": SECRET_HEADER, "hmac": SIGNATURE_HEADER}
    expected_text = " or ".join(wanted[s] for s in schemes)
    raise WebhookSignatureError(f"unauthenticated {provider} webhook: expected {expected_text}")


# -- one request, end to end --


def _events(provider: str, data: Any) -> list[Mapping[str, Any]]:
    items = data if isinstance(data, list) else [data]
    if not all(isinstance(item, Mapping) for item in items):
        raise WebhookPayloadError(f"a {provider} webhook body must be a JSON object or a list of objects")
    return items


def handle_webhook(
    provider: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    secret: str | Sequence[str],
    ledger: Ledger,
    now: float | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> WebhookOutcome:
    """Verify, parse and reconcile one webhook request (one event, or SendGrid's list of them).

    Raises :class:`WebhookSignatureError` before reading the body when the request
    is not authenticated, :class:`WebhookPayloadError` for a body that is not the
    provider's JSON, and lets ledger errors through (answer 5xx: the provider
    retries). Keys the ledger does not know are reported, not raised, so one stale
    event does not make the provider retry a whole batch.
    """
    verify(provider, headers, body, secret=secret, now=now, tolerance=tolerance)
    try:
        data = json.loads(body)
    except ValueError:
        raise WebhookPayloadError(f"the {provider} webhook body is not JSON") from None
    confirmed: list[Record] = []
    unknown: list[str] = []
    ignored = 0
    for event in _events(provider, data):
        if event.get("Type") == "SubscriptionConfirmation":
            logger.warning("idemmail: SNS asks to confirm a subscription to %s: visit %s",
                           event.get("TopicArn"), event.get("SubscribeURL"))
        try:
            record = reconcile(event, ledger=ledger, provider=provider)
        except RecordNotFoundError as exc:
            logger.warning("idemmail: %s", exc)
            found = evidence(event, provider=provider)
            unknown.append(found.key if found else "")
            continue
        if record is None:
            ignored += 1
        else:
            confirmed.append(record)
    return WebhookOutcome(confirmed, unknown, ignored)


def webhook_app(
    ledger: Ledger,
    provider: str = "postmark",
    *,
    secret: str | Sequence[str],
    tolerance: float = DEFAULT_TOLERANCE,
    max_body: int = DEFAULT_MAX_BODY,
) -> Callable[[WSGIEnvironment, StartResponse], Iterable[bytes]]:
    """A WSGI application receiving ``provider``'s webhook at any path (mount it where you like).

    Answers ``200 {"confirmed": n, "unknown": m, "ignored": k}``; 401 when the
    request is not authenticated (with a basic auth challenge where the provider
    uses basic auth); 400 for a body that is not the provider's JSON; 405, 411, 413
    for a wrong method, no length, a body over ``max_body``; 503 when the ledger
    fails, so the provider retries later.
    """
    if provider not in SCHEMES:
        raise ConfigurationError(f"no webhook support for {provider!r} (known: {', '.join(PROVIDERS)})")
    _secrets(secret)

    def reply(start_response: StartResponse, status: str, payload: Mapping[str, Any],
              extra: Sequence[tuple[str, str]] = ()) -> list[bytes]:
        data = json.dumps(payload).encode("utf-8")
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *extra])
        return [data]

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "POST":
            return reply(start_response, "405 Method Not Allowed", {"error": "POST only"}, [("Allow", "POST")])
        length = str(environ.get("CONTENT_LENGTH") or "")
        if not length.isdigit():
            return reply(start_response, "411 Length Required", {"error": "send a Content-Length"})
        if int(length) > max_body:
            return reply(start_response, "413 Content Too Large", {"error": f"body over {max_body} bytes"})
        body = environ["wsgi.input"].read(int(length))
        headers = {key[5:].replace("_", "-").lower(): str(value)
                   for key, value in environ.items() if key.startswith("HTTP_")}
        if environ.get("CONTENT_TYPE"):
            headers["content-type"] = str(environ["CONTENT_TYPE"])
        try:
            outcome = handle_webhook(provider, headers, body, secret=secret, ledger=ledger, tolerance=tolerance)
        except WebhookSignatureError as exc:
            basic = "basic" in SCHEMES[provider]
            challenge = [("WWW-Authenticate", 'Basic realm="idemmail-webhooks"')] if basic else []
            return reply(start_response, "401 Unauthorized", {"error": str(exc)}, challenge)
        except WebhookPayloadError as exc:
            return reply(start_response, "400 Bad Request", {"error": str(exc)})
        except LedgerError as exc:
            logger.error("idemmail: %s webhook could not be recorded: %s", provider, exc)
            return reply(start_response, "503 Service Unavailable", {"error": "ledger unavailable; retry later"})
        return reply(start_response, "200 OK", {"confirmed": len(outcome.confirmed),
                                                "unknown": len(outcome.unknown_keys), "ignored": outcome.ignored})

    return app
