"""Postmark (``postmark://``), and the machinery shared by HTTP providers without an idempotency key.

**Postmark has no idempotency key**, and neither have SendGrid (:mod:`.sendgrid`) nor
Amazon SES (:mod:`.ses`): a request sent twice is two emails. So these providers set
:attr:`~idemmail_celery.providers.base.Provider.accepts_idempotency_key` to False
and the state machine never resends an attempt that may have gone out. Instead,
every message is *tagged* with the intent key, twice: a header
``X-Idemmail-Key: <key>`` in the email, and the provider's own metadata field
(Postmark ``Metadata``, SendGrid ``custom_args``, SES ``EmailTags``) under the name
``idemmail_key``, which comes back in the provider's search results and webhook
events. An ambiguous send (a 5xx, a timeout, a connection dropped after the
request was written) is then *reconciled*, never guessed:

* where the provider can be searched by that tag (Postmark, SendGrid),
  :meth:`find_sent` asks it: found means sent, with the provider's message id;
  not found returns None and the intent is parked in ``review``, because
  search indexes lag and absence is not proof;
* a delivery webhook (:mod:`idemmail_celery.webhooks`) later moves a parked
  ``review`` record to ``sent`` with the provider's message id.

**Which layer protects you** with Postmark: the ledger (one claim per intent, at
most one send), then reconciliation through Postmark's outbound message search
by metadata, then the Delivery webhook. Postmark itself de-duplicates nothing.

URL and options::

    postmark://[?base_url=https://api.postmarkapp.com&message_stream=outbound&timeout=10&connect_timeout=5]

``base_url`` points at another server (a fake in tests); ``http://`` is accepted
only for loopback hosts. The server token comes from ``api_key=``
(``idemmail_provider_api_key``) or the environment variable
``POSTMARK_SERVER_TOKEN``; it never goes in the URL and never appears in a repr,
a log line or an exception.

How Postmark's answers map onto the provider contract (:mod:`.base`):

=======================================  =============================================
Postmark answered                        raised (``reason``)
=======================================  =============================================
2xx, ``ErrorCode`` 0                     ``SendResult`` with ``MessageID``
401 / 403                                ``TransientSendError`` (``auth``), logged once
422 (bad input, with an ``ErrorCode``)   ``PermanentSendError`` (``rejected``)
429                                      ``TransientSendError`` (``rate_limited``)
5xx, read timeout, dropped after write   ``AmbiguousSendError``
connection refused or connect timeout    ``TransientSendError`` (``connect``)
=======================================  =============================================
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import SplitResult, parse_qs, urlsplit, urlunsplit

import httpx

from ..email import EmailMessage
from ..errors import AmbiguousSendError, ConfigurationError, PermanentSendError, TransientSendError
from .base import Provider, SendResult
from .http import REQUEST_ID_HEADERS, _is_loopback, _retry_after, _user_agent

__all__ = ["KEY_HEADER", "KEY_TAG", "POSTMARK_API_URL", "KeylessHTTPProvider", "PostmarkProvider"]

logger = logging.getLogger(__name__)

#: The email header that carries the intent key.
KEY_HEADER = "X-Idemmail-Key"
#: The name of the intent key in the provider's metadata (Metadata, custom_args, EmailTags).
KEY_TAG = "idemmail_key"
POSTMARK_API_URL = "https://api.postmarkapp.com"
_MAX_ERROR_TEXT = 500

# "Once per process and provider", also in forked workers: remember which pid logged.
_auth_logged: dict[str, int] = {}
_auth_log_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _auth_log_lock
    _auth_log_lock = threading.Lock()  # a parent thread may have held it at fork()


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_after_fork_in_child)


class KeylessHTTPProvider(Provider):
    """Base of the JSON-over-HTTPS providers that do not de-duplicate: Postmark, SendGrid, SES.

    Subclasses say where to send (:meth:`_default_base_url`, :meth:`_build`), how to
    authenticate (:meth:`_authorize`) and how to read an acceptance
    (:meth:`_result`); this class owns the connection pool, the error mapping of the
    module docstring, and keeping credentials out of every message. ``timeout``
    bounds reading and writing, ``connect_timeout`` connecting. Safe to share between
    threads and across ``fork()`` (the client is created lazily, and anew in a child).
    """

    accepts_idempotency_key = False
    #: URL schemes this provider serves.
    schemes: ClassVar[tuple[str, ...]] = ()
    #: Where the credential may come from when ``api_key=`` is not given.
    api_key_env_vars: ClassVar[tuple[str, ...]] = ()
    #: Options accepted in the URL's query string (besides base_url and the timeouts).
    url_options: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float | None = None,
        connect_timeout: float | None = None,
        **options: Any,
    ) -> None:
        host, query = self._parse_url(url)
        settings = {name: value for name, value in options.items() if name in self.url_options and value is not None}
        self._configure(host, {**query, **{k: str(v) for k, v in settings.items()}})
        self.base_url = _base_url(base_url or query.get("base_url") or self._default_base_url())
        secret = api_key or next((os.environ[v] for v in self.api_key_env_vars if os.environ.get(v)), None)
        if not secret:
            raise ConfigurationError(
                f"the {self.name} provider needs credentials: set idemmail_provider_api_key (api_key=) "
                f"or {' / '.join(self.api_key_env_vars)}"
            )
        self.__secret = secret
        read = _seconds(timeout if timeout is not None else query.get("timeout"), 10.0, "timeout")
        connect = _seconds(connect_timeout if connect_timeout is not None else query.get("connect_timeout"),
                           5.0, "connect_timeout")
        self.timeout = httpx.Timeout(read, connect=connect, pool=connect)
        self._user_agent = _user_agent()
        self._client: httpx.Client | None = None
        self._client_pid: int | None = None
        self._client_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, api_key=<hidden>)"

    __str__ = __repr__

    # -- what subclasses provide --

    def _configure(self, host: str, options: Mapping[str, str]) -> None:
        """Read the URL's host part and the provider's own options (already checked by name)."""
        if host:
            raise ConfigurationError(f"{self.schemes[0]}:// takes no host; use ?base_url= to point elsewhere")

    def _default_base_url(self) -> str:
        raise NotImplementedError

    def _build(self, message: EmailMessage, key: str) -> tuple[str, dict[str, Any]]:
        """The path to POST to and the JSON body for ``message`` tagged with ``key``."""
        raise NotImplementedError

    def _authorize(self, request: httpx.Request, secret: str) -> None:
        """Add the credential to ``request`` (a header, or a signature over it)."""
        raise NotImplementedError

    def _result(self, response: httpx.Response, key: str) -> SendResult:
        """Read an accepted send's answer."""
        raise NotImplementedError

    def _secrets(self, secret: str) -> tuple[str, ...]:
        """The parts of the credential that must never be shown (all of it, by default)."""
        return (secret,)

    # -- the connection pool --

    def _http(self) -> httpx.Client:
        pid = os.getpid()
        if self._client_pid is not None and self._client_pid != pid:
            # First use after fork(): a parent thread may have held the inherited lock at that moment,
            # and nobody in this process would ever release it.
            self._client_lock = threading.Lock()
        with self._client_lock:
            if self._client is None or self._client_pid != pid:
                # A client inherited through fork() shares its sockets with the parent:
                # abandon it without closing, which would disturb the parent's connections.
                self._client = httpx.Client(timeout=self.timeout, follow_redirects=False)
                self._client_pid = pid
            return self._client

    def close(self) -> None:
        """Close the connection pool; the next call opens a new one."""
        with self._client_lock:
            client, self._client = self._client, None
            if client is not None and self._client_pid == os.getpid():
                client.close()

    # -- sending --

    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """Send ``message`` once, tagged with ``key`` (header and provider metadata).

        Returns the provider's message id. Raises ``TransientSendError`` (nothing was
        accepted: connect failed, credentials refused, rate limited),
        ``PermanentSendError`` (the message was refused for good) or
        ``AmbiguousSendError`` (it may have been accepted: never resend it blindly,
        ask :meth:`find_sent` or wait for the webhook).
        """
        if not key:
            raise PermanentSendError(f"the {self.name} provider needs the intent key to tag the message", "missing_key")
        path, payload = self._build(message, key)
        body = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        response = self._call("POST", path, key, content=body)
        self._check(response, key)
        return self._result(response, key)

    def _call(
        self,
        method: str,
        path: str,
        key: str,
        *,
        content: bytes | None = None,
        params: Mapping[str, str] | None = None,
        search: bool = False,
    ) -> httpx.Response:
        """One request; transport failures mapped onto the contract (a search can never be ambiguous)."""
        client = self._http()
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        if content is not None:
            headers["Content-Type"] = "application/json"
        request = client.build_request(method, self.base_url + path, content=content, params=params, headers=headers)
        self._authorize(request, self.__secret)
        where = f"{self.name} at {self.base_url}"
        # Raised "from None": an httpx exception holds the request, credentials included,
        # and error reporters that walk __cause__ would carry it along.
        try:
            return client.send(request)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ProxyError) as exc:
            # No connection was made, so no byte of the request left this process.
            raise TransientSendError(self._scrub(f"cannot connect to {where}: {exc}"), "connect", key) from None
        except httpx.HTTPError as exc:
            if search:
                raise TransientSendError(self._scrub(f"searching {where} failed: {exc!r}"), "search_failed",
                                         key) from None
            if isinstance(exc, httpx.TimeoutException):
                raise AmbiguousSendError(self._scrub(f"{where} timed out: {exc!r}"), "timeout", key) from None
            if isinstance(exc, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)):
                raise AmbiguousSendError(self._scrub(f"connection to {where} dropped before a response: {exc!r}"),
                                         "connection_dropped", key) from None
            # Any other transport failure happened with the request possibly on the wire.
            raise AmbiguousSendError(self._scrub(f"{where} failed: {exc!r}"), "transport_error", key) from None

    def _check(self, response: httpx.Response, key: str, *, search: bool = False) -> None:
        """Raise the contract's error for a non-2xx answer (for a search, always ``TransientSendError``)."""
        status = response.status_code
        if 200 <= status < 300:
            return
        name, text = self._error_detail(response)
        detail = (f"{self.name} answered {status}" + (f" ({name})" if name else "") + (f": {text}" if text else ""))
        throttled = any(word in name for word in ("Throttl", "TooManyRequests", "LimitExceeded"))
        if status in (401, 403):
            self._log_auth_once(status)
            raise TransientSendError(detail, "auth", key)
        if status == 429 or throttled:
            raise TransientSendError(detail, "rate_limited", key, _retry_after(response))
        if search:
            raise TransientSendError(detail, "search_failed", key)
        if status == 408:
            # The server gave up waiting for our request: it did not process it.
            raise TransientSendError(detail, "request_timeout", key)
        if status in (400, 413, 422):
            raise PermanentSendError(detail, "rejected", key)
        if 400 <= status < 500:
            raise PermanentSendError(detail, f"http_{status}", key)
        # 5xx and anything unexpected: the request arrived and we cannot tell what became of it.
        raise AmbiguousSendError(detail, f"http_{status}", key)

    def _search(self, path: str, key: str, params: Mapping[str, str]) -> Any:
        """GET a search endpoint and return its JSON; ``TransientSendError`` when the provider cannot be asked."""
        response = self._call("GET", path, key, params=params, search=True)
        self._check(response, key, search=True)
        try:
            return response.json()
        except ValueError:
            raise TransientSendError(f"{self.name} search answered with something that is not JSON",
                                     "search_failed", key) from None

    def _request_id(self, response: httpx.Response) -> str | None:
        return next((response.headers[h] for h in REQUEST_ID_HEADERS if h in response.headers), None)

    def _accepted_without_id(self, response: httpx.Response, key: str) -> SendResult:
        # Accepted all the same: raising would make the caller treat something that went out as failed.
        logger.warning("%s accepted the message for %s but its answer has no message id (HTTP %s)",
                       self.name, key, response.status_code)
        return SendResult(message_id="", provider=self.name, request_id=self._request_id(response),
                          extra={"response": self._scrub(response.text[:_MAX_ERROR_TEXT])})

    def _error_detail(self, response: httpx.Response) -> tuple[str, str]:
        """The provider's error name and message, from any of the three shapes, credentials scrubbed."""
        name = response.headers.get("x-amzn-errortype", "").split(":", 1)[0]
        try:
            data = response.json()
        except ValueError:
            data = None
        if isinstance(data, Mapping):
            if "ErrorCode" in data and not name:
                name = f"ErrorCode {data['ErrorCode']}"
            text = data.get("Message") or data.get("message") or ""
            errors = data.get("errors")
            if isinstance(errors, list):
                text = "; ".join(str(e.get("message", "")) for e in errors if isinstance(e, Mapping)) or text
        else:
            text = response.text
        return self._scrub(str(name))[:100], self._scrub(" ".join(str(text).split()))[:_MAX_ERROR_TEXT]

    def _scrub(self, text: str) -> str:
        # A provider (or a proxy in front of it) may echo a credential in an error.
        for part in self._secrets(self.__secret):
            if part:
                text = text.replace(part, "<credential>")
        return text

    def _log_auth_once(self, status: int) -> None:
        with _auth_log_lock:
            if _auth_logged.get(self.name) == os.getpid():
                return
            _auth_logged[self.name] = os.getpid()
        logger.error(
            "%s rejected the credentials (HTTP %s from %s); nothing was sent. Check idemmail_provider_api_key "
            "or %s. Sends are retried until it is fixed.",
            self.name, status, self.base_url, " / ".join(self.api_key_env_vars),
        )

    def _parse_url(self, url: str) -> tuple[str, dict[str, str]]:
        try:
            parts = urlsplit(url)
        except ValueError as exc:
            raise ConfigurationError(f"bad provider URL: {exc}") from None
        if parts.scheme.lower() not in self.schemes:
            raise ConfigurationError(f"the {self.name} provider takes {' or '.join(s + '://' for s in self.schemes)}")
        if "@" in parts.netloc:
            raise ConfigurationError("put credentials in idemmail_provider_api_key, not the URL")
        query: dict[str, str] = {}
        for name, values in parse_qs(parts.query, keep_blank_values=True).items():
            if name not in (*self.url_options, "base_url", "timeout", "connect_timeout"):
                raise ConfigurationError(f"unknown {self.name} URL option {name!r}")
            query[name] = values[-1]
        return parts.netloc, query


class PostmarkProvider(KeylessHTTPProvider):
    """Sends through Postmark's ``POST /email``; searches ``GET /messages/outbound`` by metadata.

    ``url`` is ``postmark://`` (options in the module docstring, also accepted as
    keywords: ``base_url=``, ``message_stream=``, ``timeout=``, ``connect_timeout=``).
    Raises :class:`ConfigurationError` for a bad URL or no server token.
    """

    name = "postmark"
    schemes = ("postmark",)
    api_key_env_vars = ("POSTMARK_SERVER_TOKEN",)
    url_options = ("message_stream",)

    def _configure(self, host: str, options: Mapping[str, str]) -> None:
        super()._configure(host, options)
        self.message_stream = options.get("message_stream") or None

    def _default_base_url(self) -> str:
        return POSTMARK_API_URL

    def _authorize(self, request: httpx.Request, secret: str) -> None:
        request.headers["X-Postmark-Server-Token"] = secret

    def _build(self, message: EmailMessage, key: str) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"From": message.sender, "Subject": message.subject}
        for field, addresses in (("To", message.to), ("Cc", message.cc), ("Bcc", message.bcc),
                                 ("ReplyTo", message.reply_to)):
            if addresses:
                body[field] = ", ".join(addresses)
        if message.html is not None:
            body["HtmlBody"] = message.html
        if message.text is not None:
            body["TextBody"] = message.text
        body["Headers"] = [{"Name": name, "Value": value} for name, value in tagged_headers(message, key)]
        body["Metadata"] = {**message.tags, KEY_TAG: key}
        if self.message_stream:
            body["MessageStream"] = self.message_stream
        if message.attachments:
            body["Attachments"] = [
                {"Name": a["filename"], "Content": a["content_b64"], "ContentType": a["content_type"]}
                for a in message.to_payload()["attachments"]
            ]
        return "/email", body

    def _result(self, response: httpx.Response, key: str) -> SendResult:
        try:
            data = response.json()
        except ValueError:
            data = None
        if isinstance(data, Mapping):
            code = data.get("ErrorCode", 0)
            if code not in (0, None):
                # A 2xx that says "error" is not an answer we can trust either way.
                name, text = self._error_detail(response)
                raise AmbiguousSendError(f"postmark answered {response.status_code} with {name}: {text}",
                                         "unexpected_response", key)
            message_id = data.get("MessageID")
            if isinstance(message_id, str) and message_id:
                return SendResult(message_id=message_id, provider=self.name, request_id=self._request_id(response))
        return self._accepted_without_id(response, key)

    def find_sent(self, key: str) -> SendResult | None:
        """The message Postmark holds under metadata ``idemmail_key == key``, or None when it has none (yet).

        Postmark's outbound search is an index that lags the send by seconds, so None
        is not proof of absence: the caller parks the intent for review, and the
        Delivery webhook settles it. Raises ``TransientSendError`` when Postmark cannot
        be asked (connect, credentials, rate limit, an error answer).
        """
        data = self._search("/messages/outbound", key, {"count": "1", "offset": "0", f"metadata_{KEY_TAG}": key})
        messages = data.get("Messages") if isinstance(data, Mapping) else None
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], Mapping):
            return None
        found = messages[0]
        metadata = found.get("Metadata")
        if isinstance(metadata, Mapping) and metadata.get(KEY_TAG) != key:
            # Guard against a search that ignored the filter and returned someone else's message.
            logger.warning("postmark search for %s returned a message tagged otherwise; ignoring it", key)
            return None
        message_id = found.get("MessageID")
        if not isinstance(message_id, str) or not message_id:
            return None
        return SendResult(message_id=message_id, provider=self.name,
                          extra={"found_by": "search", "status": found.get("Status")})


def tagged_headers(message: EmailMessage, key: str) -> list[tuple[str, str]]:
    """The message's headers, sorted, plus ``X-Idemmail-Key: key`` (replacing any header of that name)."""
    kept = [(name, value) for name, value in sorted(message.headers.items()) if name.lower() != KEY_HEADER.lower()]
    return [*kept, (KEY_HEADER, key)]


def _base_url(url: str) -> str:
    """``url`` without a trailing slash, or :class:`ConfigurationError` (http:// only for loopback)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"bad base_url: {exc}") from None
    scheme = parts.scheme.lower()
    host = parts.hostname
    if scheme not in ("https", "http") or not host:
        raise ConfigurationError(f"base_url must be https://host[:port][/path], got {url!r}")
    if "@" in parts.netloc:
        raise ConfigurationError("put credentials in idemmail_provider_api_key, not the URL")
    if scheme == "http" and not _is_loopback(host):
        raise ConfigurationError(f"http:// would send credentials in clear text to {host}; use https://")
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port is not None else "")
    return urlunsplit(SplitResult(scheme, netloc, parts.path.rstrip("/"), "", ""))


def _seconds(value: float | str | None, default: float, name: str) -> float:
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}") from None
    if seconds <= 0:
        raise ConfigurationError(f"{name} must be positive")
    return seconds
