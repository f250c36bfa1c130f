"""Provider webhooks: a delivery event, tagged with its intent key, moves a parked record to ``sent``.

Which events confirm a send, and where their key is: docs/providers.md, "Delivery webhooks"; how each
request is authenticated (:class:`WebhookAuth`, or ``secret=``) and what a bad one is answered:
docs/security.md, "Webhooks". The HMAC scheme for a relay: ``X-Idemmail-Timestamp: <unix seconds>`` and
``X-Idemmail-Signature: v1=<hex HMAC-SHA256(secret, timestamp + "." + raw body)>`` (:func:`hmac_headers`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ._common import logsafe
from .chain import KEY_TAG
from .errors import ConfigurationError, LedgerError, RecordNotFoundError, WebhookPayloadError, WebhookSignatureError
from .ledger.base import Ledger, Record

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

__all__ = [
    "MAX_DEPTH", "PROVIDERS", "SECRET_HEADER", "SENDGRID_SIGNATURE_HEADER", "SENDGRID_TIMESTAMP_HEADER",
    "SIGNATURE_HEADER", "TIMESTAMP_HEADER", "DeliveryEvidence", "WebhookAuth", "WebhookOutcome",
    "WebhookPayloadError", "WebhookSignatureError", "evidence", "handle_webhook", "hmac_headers", "reconcile",
    "verify", "webhook_app", "webhook_asgi_app",
]

logger = logging.getLogger(__name__)

PROVIDERS = ("postmark", "sendgrid", "ses")
SIGNATURE_HEADER = "X-Idemmail-Signature"
TIMESTAMP_HEADER = "X-Idemmail-Timestamp"
SECRET_HEADER = "X-Idemmail-Webhook-Secret"
SENDGRID_SIGNATURE_HEADER = "X-Twilio-Email-Event-Webhook-Signature"
SENDGRID_TIMESTAMP_HEADER = "X-Twilio-Email-Event-Webhook-Timestamp"
DEFAULT_TOLERANCE = 300.0
DEFAULT_MAX_BODY = 1024 * 1024
#: Deepest nesting of a webhook body (objects and arrays) that is read; providers send 4 or 5 levels.
MAX_DEPTH = 32

#: How each provider may authenticate its requests (docs/security.md, "Webhooks").
SCHEMES: Mapping[str, tuple[str, ...]] = {"postmark": ("basic", "header"), "sendgrid": ("ecdsa", "hmac"),
                                          "ses": ("basic", "hmac", "sns")}
_CONFIRMING = {"postmark": ("Delivery",), "sendgrid": ("processed", "delivered"), "ses": ("Send", "Delivery")}
#: A timestamp or a Content-Length: 1 to 12 ASCII digits.
_DIGITS = re.compile(r"[0-9]{1,12}")
_SNS_HOST = re.compile(r"sns\.([a-z0-9-]{1,32})\.amazonaws\.com")
_TOPIC_ARN = re.compile(r"arn:aws:sns:([a-z0-9-]{1,32}):[0-9]{12}:[A-Za-z0-9_.-]{1,256}")
_MAX_MESSAGE_ID = 998
_MAX_CERTIFICATE = 64 * 1024


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


def loads(body: bytes | str, what: str = "webhook body") -> Any:
    """``body`` parsed as JSON, or :class:`WebhookPayloadError`: never a RecursionError or a digit-limit error."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, an integer past Python's digit limit, too deep
        raise WebhookPayloadError(f"the {what} is not JSON this endpoint reads") from None
    if _depth_over(data, MAX_DEPTH):
        raise WebhookPayloadError(f"the {what} nests deeper than {MAX_DEPTH} levels")
    return data


def _depth_over(data: Any, limit: int) -> bool:
    level: list[Any] = [data]
    for _ in range(limit + 1):
        level = [v for item in level if isinstance(item, (list, dict))
                 for v in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return False
    return True


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


#: What a reader finds in one provider's event: (event kind, intent key, message id), each None if absent.
_Fields = tuple[str | None, str | None, str | None]


def _postmark_fields(event: Mapping[str, Any]) -> _Fields | None:
    metadata = event.get("Metadata")
    key = _text(metadata.get(KEY_TAG)) if isinstance(metadata, Mapping) else None
    return _text(event.get("RecordType")), key, _text(event.get("MessageID"))


def _sendgrid_fields(event: Mapping[str, Any]) -> _Fields | None:
    # SendGrid puts custom args at the top level of each event.
    return _text(event.get("event")), _text(event.get(KEY_TAG)), _text(event.get("sg_message_id"))


def _ses_fields(event: Mapping[str, Any]) -> _Fields | None:
    """None for an SNS subscription confirmation or an event without its ``mail`` object."""
    inner: Any = event  # bare, or inside an SNS Notification envelope
    if event.get("Type") == "Notification":
        inner = loads(str(event.get("Message", "")), "SNS notification's Message")
    mail = inner.get("mail") if isinstance(inner, Mapping) else None
    if event.get("Type") == "SubscriptionConfirmation" or not isinstance(mail, Mapping):
        return None
    kind = _text(inner.get("eventType")) or _text(inner.get("notificationType"))
    tags = mail.get("tags")
    values = tags.get(KEY_TAG) if isinstance(tags, Mapping) else None
    key = _text(values[0]) if isinstance(values, list) and values else None
    return kind, key, _text(mail.get("messageId"))


_READERS: Mapping[str, Callable[[Mapping[str, Any]], _Fields | None]] = {
    "postmark": _postmark_fields, "sendgrid": _sendgrid_fields, "ses": _ses_fields}


def evidence(event: Mapping[str, Any], *, provider: str | None = None) -> DeliveryEvidence | None:
    """What a parsed, verified provider event proves, or None (not a confirming event, no key, a bad message id);
    :class:`WebhookPayloadError` for an event of another provider than ``provider``."""
    found = _provider_of(event)
    if provider is not None and found is not None and found != provider:
        raise WebhookPayloadError(f"a {found} event posted to the {provider} webhook")
    fields = _READERS[found](event) if found is not None else None
    if found is None or fields is None:
        return None
    kind, key, message_id = fields
    if kind not in _CONFIRMING[found] or key is None or message_id is None:
        return None
    plausible = len(message_id) <= _MAX_MESSAGE_ID and message_id.isprintable()
    return DeliveryEvidence(found, key, message_id, kind) if plausible else None


def reconcile(event: Mapping[str, Any], *, ledger: Ledger, provider: str | None = None) -> Record | None:
    """Move the record of a parsed, **already verified** confirming event to ``sent`` with ``{"message_id",
    "provider", "via": "webhook"}``; the record, or None if the event proves nothing. :class:`RecordNotFoundError`
    for a key the ledger lacks, :class:`WebhookPayloadError` for another provider's event."""
    found = evidence(event, provider=provider)
    if found is None:
        return None
    key = found.key  # could a ledger hold it? (The SQL column takes 128 characters.)
    if not (len(key) <= 128 and key.isascii() and key.isprintable() and " " not in key):
        raise RecordNotFoundError(f"{found.provider} reports {found.event} of message {found.message_id} for a "
                                  "key no ledger holds (more than 128 characters, or not printable ASCII)")
    result = {"message_id": found.message_id, "provider": found.provider, "via": "webhook"}
    try:
        record = ledger.confirm_sent(found.key, result, note=f"{found.provider} {found.event} webhook",
                                     actor=f"webhook:{found.provider}")
    except RecordNotFoundError:
        raise RecordNotFoundError(f"{found.provider} reports {found.event} of message {found.message_id} for key "
                                  f"{found.key}, but the ledger has no record of it (expired past retention, another "
                                  "ledger, or never claimed)") from None
    logger.info("idemmail: %s confirmed by %s %s webhook (message %s)", logsafe(found.key), logsafe(found.provider),
                logsafe(found.event), logsafe(found.message_id))
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


def _crypto() -> Any:
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
    except ImportError:
        raise ConfigurationError("verifying SendGrid and SNS signatures needs the cryptography package: "
                                 "pip install 'idemmail-celery[crypto]'") from None
    return type("crypto", (), {"x509": x509, "InvalidSignature": InvalidSignature, "hashes": hashes,
                               "serialization": serialization, "ec": ec, "padding": padding, "rsa": rsa})


_certificates: dict[str, Any] = {}
_certificates_lock = threading.Lock()


def _fetch_certificate(url: str) -> bytes:
    """GET the (already pinned) SNS signing certificate over verified TLS."""
    import httpx

    try:
        response = httpx.get(url, timeout=5.0, follow_redirects=False)
    except httpx.HTTPError as exc:
        what = f"the SNS signing certificate could not be fetched ({type(exc).__name__})"
        raise WebhookSignatureError(what) from None
    if response.status_code != 200 or len(response.content) > _MAX_CERTIFICATE:
        raise WebhookSignatureError(f"the SNS signing certificate could not be fetched (HTTP {response.status_code})")
    return response.content


#: The header whose presence says a request uses the scheme (basic auth and SNS are told otherwise).
_SCHEME_HEADER = {"header": SECRET_HEADER, "hmac": SIGNATURE_HEADER, "ecdsa": SENDGRID_SIGNATURE_HEADER}
#: How an unauthenticated request is told what each scheme expects.
_WANTED = {"basic": "Authorization: Basic", **_SCHEME_HEADER, "sns": "an SNS signature"}


@dataclass(frozen=True)
class _Request:
    """One webhook request as the scheme checks read it (``headers`` keyed by lower-case name)."""

    headers: Mapping[str, str]
    body: bytes
    now: float
    tolerance: float

    def header(self, name: str) -> str:
        return self.headers.get(name.lower(), "")

    def carries(self, scheme: str) -> bool:
        """Does the request use ``scheme`` (whether or not it will authenticate)?"""
        if scheme == "basic":
            return self.header("Authorization")[:6].lower() == "basic "
        if scheme == "sns":
            return b'"SigningCertURL"' in self.body  # the signed envelope is the body itself
        return _SCHEME_HEADER[scheme].lower() in self.headers

    def fresh_timestamp(self, name: str, what: str) -> str:
        """The timestamp in header ``name``; :class:`WebhookSignatureError` unless within the tolerance."""
        stamp = self.header(name)
        if not _DIGITS.fullmatch(stamp):
            raise WebhookSignatureError(f"the {what} needs a timestamp in unix seconds (1 to 12 digits)")
        if abs(self.now - int(stamp)) > self.tolerance:
            raise WebhookSignatureError(f"the {what}'s timestamp is more than {self.tolerance:.0f} s from now")
        return stamp


@dataclass(frozen=True)
class WebhookAuth:
    """What a webhook endpoint accepts as proof of origin (docs/security.md, "Webhooks"); ``secret`` may be a
    list (to rotate), ``sns_certificates`` replaces the certificate fetch (pinned URL -> PEM bytes).
    :class:`ConfigurationError` for a value that cannot work, or without ``cryptography`` for a signature."""

    secret: str | Sequence[str] | None = field(default=None, repr=False)
    sendgrid_public_key: str | None = field(default=None, repr=False)
    sns_topic_arns: Sequence[str] = ()
    sns_certificates: Callable[[str], bytes] | None = field(default=None, repr=False)
    _keys: list[bytes] = field(init=False, repr=False, compare=False, default_factory=list)
    _ecdsa_key: Any = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if self.secret is not None:
            object.__setattr__(self, "_keys", _secrets(self.secret))
        if self.sendgrid_public_key is not None:
            object.__setattr__(self, "_ecdsa_key", _ecdsa_public_key(self.sendgrid_public_key))
        if isinstance(self.sns_topic_arns, str):
            object.__setattr__(self, "sns_topic_arns", (self.sns_topic_arns,))
        for arn in self.sns_topic_arns:
            if not (isinstance(arn, str) and _TOPIC_ARN.fullmatch(arn)):
                raise ConfigurationError(f"not an SNS topic ARN: {arn!r} (arn:aws:sns:REGION:ACCOUNT:NAME)")
        if self.sns_topic_arns:
            _crypto()

    def schemes(self, provider: str) -> tuple[str, ...]:
        """The schemes ``provider``'s requests may use with what is configured here."""
        have = {"basic": bool(self._keys), "header": bool(self._keys), "hmac": bool(self._keys),
                "ecdsa": self._ecdsa_key is not None, "sns": bool(self.sns_topic_arns)}
        return tuple(s for s in SCHEMES[provider] if have[s])

    def _usable_schemes(self, provider: str) -> tuple[str, ...]:
        _check_provider(provider)
        schemes = self.schemes(provider)
        if not schemes:
            raise ConfigurationError(f"nothing configured that authenticates {provider} webhooks "
                                     f"(it can use: {', '.join(SCHEMES[provider])})")
        return schemes

    def verify(self, provider: str, headers: Mapping[str, str], body: bytes, *, now: float | None = None,
               tolerance: float = DEFAULT_TOLERANCE) -> str:
        """The scheme that authenticated the request, or :class:`WebhookSignatureError`. See :func:`verify`."""
        schemes = self._usable_schemes(provider)
        request = _Request({name.lower(): value for name, value in headers.items()}, body,
                           time.time() if now is None else now, tolerance)
        # Looked for in this order, whatever the provider's: a request carrying two schemes is judged by the first.
        checks = {"basic": self._check_basic, "header": self._check_header, "hmac": self._check_hmac,
                  "ecdsa": self._check_ecdsa, "sns": self._check_sns}
        for scheme, check in checks.items():
            if scheme in schemes and request.carries(scheme):
                check(request)
                return scheme
        raise WebhookSignatureError(f"unauthenticated {provider} webhook: expected "
                                    f"{' or '.join(_WANTED[s] for s in schemes)}")

    # Each scheme's check, for a request that carries the scheme: WebhookSignatureError unless it authenticates.

    def _check_basic(self, request: _Request) -> None:
        try:
            presented = base64.b64decode(request.header("Authorization")[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            raise WebhookSignatureError("the basic auth credentials are malformed") from None
        if not _any_equal(presented, self._keys):
            raise WebhookSignatureError("the basic auth credentials do not match")

    def _check_header(self, request: _Request) -> None:
        if not _any_equal(request.header(SECRET_HEADER).encode("utf-8", "replace"), self._keys):
            raise WebhookSignatureError(f"the {SECRET_HEADER} header does not match")

    def _check_hmac(self, request: _Request) -> None:
        stamp = request.fresh_timestamp(TIMESTAMP_HEADER, "signature")
        offered = [part.strip()[3:].encode("ascii", "replace")
                   for part in request.header(SIGNATURE_HEADER).split(",") if part.strip().startswith("v1=")]
        expected = [_signature(k, stamp, request.body).encode("ascii") for k in self._keys]
        if not any(_any_equal(o, expected) for o in offered):
            raise WebhookSignatureError("the signature does not match the body")

    def _check_ecdsa(self, request: _Request) -> None:
        stamp = request.fresh_timestamp(SENDGRID_TIMESTAMP_HEADER, "SendGrid signature")
        crypto = _crypto()
        try:
            der = base64.b64decode(request.header(SENDGRID_SIGNATURE_HEADER).strip(), validate=True)
            self._ecdsa_key.verify(der, stamp.encode("ascii") + request.body, crypto.ec.ECDSA(crypto.hashes.SHA256()))
        except (binascii.Error, ValueError, crypto.InvalidSignature):
            raise WebhookSignatureError("the SendGrid signature does not match the body") from None

    def _check_sns(self, request: _Request) -> None:
        crypto = _crypto()
        try:
            message = loads(request.body, "SNS message")
        except WebhookPayloadError as exc:
            raise WebhookSignatureError(f"unauthenticated: {exc}") from None
        if not isinstance(message, Mapping):
            raise WebhookSignatureError("unauthenticated: the SNS message is not a JSON object")
        topic = message.get("TopicArn")
        if topic not in self.sns_topic_arns:
            raise WebhookSignatureError("the SNS message's TopicArn is not one this endpoint is subscribed to")
        region = _TOPIC_ARN.fullmatch(str(topic)).group(1)  # type: ignore[union-attr]  # in the allow-list
        url = message.get("SigningCertURL")
        if not isinstance(url, str) or not _pinned_certificate_url(url, region):
            raise WebhookSignatureError(f"the SNS SigningCertURL is not https://sns.{region}.amazonaws.com/...pem")
        version = message.get("SignatureVersion")
        digest = {"1": crypto.hashes.SHA1, "2": crypto.hashes.SHA256}.get(version if isinstance(version, str) else "")
        if digest is None:
            raise WebhookSignatureError("unknown SNS SignatureVersion (1 or 2 are known)")
        signed = _sns_string_to_sign(message)
        try:
            signature = base64.b64decode(str(message.get("Signature", "")), validate=True)
            certificate = self._certificate(url, crypto)
            valid_now = (certificate.not_valid_before_utc.timestamp() <= request.now
                         <= certificate.not_valid_after_utc.timestamp())
            public_key = certificate.public_key()
            if not valid_now or not isinstance(public_key, crypto.rsa.RSAPublicKey):
                raise WebhookSignatureError("the SNS signing certificate is expired or not an RSA key")
            public_key.verify(signature, signed.encode("utf-8"), crypto.padding.PKCS1v15(), digest())
        except (binascii.Error, ValueError, crypto.InvalidSignature):
            raise WebhookSignatureError("the SNS signature does not match the message") from None

    def _certificate(self, url: str, crypto: Any) -> Any:
        with _certificates_lock:
            cached = _certificates.get(url) if self.sns_certificates is None else None
        if cached is not None:
            return cached
        pem = (self.sns_certificates or _fetch_certificate)(url)
        try:
            certificate = crypto.x509.load_pem_x509_certificate(pem)
        except ValueError:
            raise WebhookSignatureError("the SNS signing certificate is not a PEM certificate") from None
        if self.sns_certificates is None:
            with _certificates_lock:
                if len(_certificates) > 64:  # AWS rotates them rarely; keep the cache small all the same
                    _certificates.clear()
                _certificates[url] = certificate
        return certificate


def _ecdsa_public_key(text: str) -> Any:
    crypto = _crypto()
    try:
        raw = text.strip().encode("ascii")
        key = (crypto.serialization.load_pem_public_key(raw) if raw.startswith(b"-----BEGIN")
               else crypto.serialization.load_der_public_key(base64.b64decode(raw, validate=True)))
    except (ValueError, binascii.Error, UnicodeError):
        raise ConfigurationError("sendgrid_public_key is not a public key (base64 DER or PEM)") from None
    if not isinstance(key, crypto.ec.EllipticCurvePublicKey):
        raise ConfigurationError("sendgrid_public_key is not an elliptic-curve key")
    return key


def _pinned_certificate_url(url: str, region: str) -> bool:
    """Is ``url`` SNS's own certificate location for ``region`` (https, sns.<region>.amazonaws.com, a .pem)?"""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return False
    host = _SNS_HOST.fullmatch(parts.hostname or "")
    return (parts.scheme == "https" and host is not None and host.group(1) == region
            and parts.netloc == parts.hostname and port is None and parts.path.endswith(".pem")
            and not parts.query and not parts.fragment)


_SUBSCRIPTION_FIELDS = ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type")
_SNS_SIGNED_FIELDS = {"Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
                      "SubscriptionConfirmation": _SUBSCRIPTION_FIELDS, "UnsubscribeConfirmation": _SUBSCRIPTION_FIELDS}


def _sns_string_to_sign(message: Mapping[str, Any]) -> str:
    """What SNS signed: ``name\\nvalue\\n`` for each signed field present, in AWS's order."""
    fields = _SNS_SIGNED_FIELDS.get(str(message.get("Type")))
    if fields is None:
        raise WebhookSignatureError("unknown SNS message Type")
    out = []
    for name in fields:
        value = message.get(name)
        if value is None and name == "Subject":
            continue
        if not isinstance(value, str):
            raise WebhookSignatureError(f"the SNS message has no {name}")
        out.append(f"{name}\n{value}\n")
    return "".join(out)


def _check_provider(provider: str) -> None:
    if provider not in SCHEMES:
        raise ConfigurationError(f"no webhook support for {provider!r} (known: {', '.join(PROVIDERS)})")


def _auth(auth: WebhookAuth | None, secret: str | Sequence[str] | None) -> WebhookAuth:
    if auth is not None and secret is not None:
        raise ConfigurationError("pass secret= or auth=, not both")
    return auth if auth is not None else WebhookAuth(secret=secret)


def verify(provider: str, headers: Mapping[str, str], body: bytes, *, secret: str | Sequence[str] | None = None,
           auth: WebhookAuth | None = None, now: float | None = None, tolerance: float = DEFAULT_TOLERANCE) -> str:
    """The scheme (``basic``, ``header``, ``hmac``...) that authenticated a request (``headers`` in any case,
    ``body`` raw), else :class:`WebhookSignatureError`; :class:`ConfigurationError` when nothing configured
    can authenticate ``provider``. ``secret`` is shorthand for ``auth=WebhookAuth(secret=...)``."""
    return _auth(auth, secret).verify(provider, headers, body, now=now, tolerance=tolerance)


# -- one request, end to end --


def handle_webhook(provider: str, headers: Mapping[str, str], body: bytes, *, ledger: Ledger,
                   secret: str | Sequence[str] | None = None, auth: WebhookAuth | None = None, now: float | None = None,
                   tolerance: float = DEFAULT_TOLERANCE) -> WebhookOutcome:
    """Verify, parse and reconcile one webhook request (one event, or SendGrid's list of them); ledger errors go
    through (answer 5xx: the provider retries), unknown keys are reported: a stale event fails no batch."""
    verify(provider, headers, body, secret=secret, auth=auth, now=now, tolerance=tolerance)
    data = loads(body, f"{provider} webhook body")
    events = data if isinstance(data, list) else [data]
    if not all(isinstance(event, Mapping) for event in events):
        raise WebhookPayloadError(f"a {provider} webhook body must be a JSON object or a list of objects")
    confirmed: list[Record] = []
    unknown: list[str] = []
    for event in events:
        if event.get("Type") == "SubscriptionConfirmation":
            logger.warning("idemmail: SNS asks to confirm a subscription to %s: visit %s",
                           logsafe(event.get("TopicArn")), logsafe(event.get("SubscribeURL")))
        try:
            record = reconcile(event, ledger=ledger, provider=provider)
        except RecordNotFoundError as exc:
            logger.warning("idemmail: %s", logsafe(exc))
            found = evidence(event, provider=provider)
            unknown.append(found.key[:128] if found else "")
            continue
        if record is not None:
            confirmed.append(record)
    return WebhookOutcome(confirmed, unknown, ignored=len(events) - len(confirmed) - len(unknown))


_Reply = tuple[str, dict[str, Any], list[tuple[str, str]]]


def _check_request(method: str, length: str | None, max_body: int, *, length_required: bool) -> _Reply | None:
    """The answer to a request refused before its body is read, or None."""
    if method != "POST":
        return "405 Method Not Allowed", {"error": "POST only"}, [("Allow", "POST")]
    if length is None or length == "":
        return ("411 Length Required", {"error": "send a Content-Length"}, []) if length_required else None
    if not _DIGITS.fullmatch(length):
        return "400 Bad Request", {"error": "the Content-Length is not a number"}, []
    if int(length) > max_body:
        return "413 Content Too Large", {"error": f"body over {max_body} bytes"}, []
    return None


def _answer(provider: str, headers: Mapping[str, str], body: bytes, ledger: Ledger, auth: WebhookAuth,
            tolerance: float) -> _Reply:
    """Handle one read request; every outcome a status line, a JSON payload and extra headers."""
    try:
        outcome = handle_webhook(provider, headers, body, auth=auth, ledger=ledger, tolerance=tolerance)
    except WebhookSignatureError as exc:
        challenge = [("WWW-Authenticate", 'Basic realm="idemmail-webhooks"')]
        return "401 Unauthorized", {"error": str(exc)}, challenge if "basic" in auth.schemes(provider) else []
    except WebhookPayloadError as exc:
        return "400 Bad Request", {"error": str(exc)}, []
    except LedgerError as exc:
        logger.error("idemmail: %s webhook could not be recorded: %s", logsafe(provider), logsafe(exc))
        return "503 Service Unavailable", {"error": "ledger unavailable; retry later"}, []
    except Exception as exc:  # a bug, or a ledger failing in a way it should have typed: no traceback to the caller
        logger.error("idemmail: %s webhook failed: %s", logsafe(provider), type(exc).__name__)
        return "500 Internal Server Error", {"error": "internal error; retry later"}, []
    return "200 OK", {"confirmed": len(outcome.confirmed), "unknown": len(outcome.unknown_keys),
                      "ignored": outcome.ignored}, []


def _configured(provider: str, auth: WebhookAuth | None, secret: str | Sequence[str] | None) -> WebhookAuth:
    _check_provider(provider)  # before the secrets are checked
    checked = _auth(auth, secret)
    checked._usable_schemes(provider)
    return checked


def webhook_app(ledger: Ledger, provider: str = "postmark", *, secret: str | Sequence[str] | None = None,
                auth: WebhookAuth | None = None, tolerance: float = DEFAULT_TOLERANCE,
                max_body: int = DEFAULT_MAX_BODY) -> Callable[[WSGIEnvironment, StartResponse], Iterable[bytes]]:
    """A WSGI application receiving ``provider``'s webhook at any path: ``200 {"confirmed": n, "unknown": m,
    "ignored": k}``, 503 when the ledger fails (the provider retries), 4xx as docs/security.md, "Webhooks" says."""
    checked = _configured(provider, auth, secret)

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        refused = _check_request(str(environ.get("REQUEST_METHOD")), str(environ.get("CONTENT_LENGTH") or ""),
                                 max_body, length_required=True)
        if refused is None:
            body = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
            headers = {key[5:].replace("_", "-").lower(): str(value)
                       for key, value in environ.items() if key.startswith("HTTP_")}
            if environ.get("CONTENT_TYPE"):
                headers["content-type"] = str(environ["CONTENT_TYPE"])
            refused = _answer(provider, headers, body, ledger, checked, tolerance)
        status, payload, extra = refused
        data = json.dumps(payload).encode("utf-8")
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *extra])
        return [data]

    return app


_ASGIReceive = Callable[[], Awaitable[dict[str, Any]]]
_ASGISend = Callable[[dict[str, Any]], Awaitable[None]]
_ASGIApp = Callable[[dict[str, Any], _ASGIReceive, _ASGISend], Awaitable[None]]


def webhook_asgi_app(ledger: Ledger, provider: str = "postmark", *, secret: str | Sequence[str] | None = None,
                     auth: WebhookAuth | None = None, tolerance: float = DEFAULT_TOLERANCE,
                     max_body: int = DEFAULT_MAX_BODY) -> _ASGIApp:
    """The same endpoint as :func:`webhook_app`, as an ASGI 3 application (mount it in Starlette/FastAPI or
    serve it alone). A chunked request needs no ``Content-Length``; the ledger call runs in a worker thread."""
    checked = _configured(provider, auth, secret)

    async def reply(send: _ASGISend, answer: _Reply) -> None:
        status, payload, extra = answer
        data = json.dumps(payload).encode("utf-8")
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode("ascii")),
                   *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in extra)]
        await send({"type": "http.response.start", "status": int(status.split()[0]), "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def app(scope: dict[str, Any], receive: _ASGIReceive, send: _ASGISend) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            return await send({"type": "lifespan.shutdown.complete"})
        if scope["type"] != "http":
            raise ValueError(f"the idemmail webhook app serves HTTP, not {scope['type']}")
        headers = {bytes(name).decode("latin-1").lower(): bytes(value).decode("latin-1")
                   for name, value in scope.get("headers") or ()}
        refused = _check_request(str(scope.get("method")), headers.get("content-length"), max_body,
                                 length_required=False)
        if refused is not None:
            return await reply(send, refused)
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body") or b""
            if len(body) > max_body:
                return await reply(send, ("413 Content Too Large", {"error": f"body over {max_body} bytes"}, []))
            more = bool(message.get("more_body"))
        answer = await asyncio.to_thread(_answer, provider, headers, bytes(body), ledger, checked, tolerance)
        await reply(send, answer)

    return app
