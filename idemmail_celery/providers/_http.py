"""What the providers built on httpx share: :class:`HTTPClientProvider` (a pooled client, created lazily and anew
after ``fork()``), the error mapping of a request that got no answer, credential scrubbing, and
:class:`KeylessHTTPProvider`, the base of Postmark, SendGrid and SES (docs/providers.md, "Postmark, SendGrid and SES").
"""

from __future__ import annotations

import email.utils
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import Any, ClassVar
from urllib.parse import SplitResult, parse_qs, urlsplit, urlunsplit

import httpx

from .._common import after_fork, logsafe
from ..email import EmailMessage
from ..errors import AmbiguousSendError, ConfigurationError, PermanentSendError, SendError, TransientSendError
from ..redaction import scrub as redact
from ..redaction import scrubbed
from .base import Provider, SendResult, about_to_send, first_time, is_loopback

#: Response headers that may carry the provider's request id, in order of preference.
REQUEST_ID_HEADERS = ("x-request-id", "request-id", "x-resend-request-id", "x-amzn-requestid")
#: How much of a server's error text goes into an exception or a stored result.
MAX_ERROR_TEXT = 500
#: How much of an answer is scrubbed before it is cut to ``MAX_ERROR_TEXT`` (a proxy's 5xx page can be large).
SCRUB_WINDOW = 64 * 1024
#: The email header that carries the intent key (keyless providers).
KEY_HEADER = "X-Idemmail-Key"

# Failures before any connection existed: no byte of the request left this process.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ProxyError)
_DROPPED_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class HTTPClientProvider(Provider):
    """A provider sending through one pooled ``httpx.Client`` (:meth:`_http`); safe across threads and ``fork()``."""

    def __init__(self, timeout: httpx.Timeout) -> None:
        self.timeout = timeout
        self._user_agent = user_agent()
        self._client: httpx.Client | None = None
        self._client_lock = threading.Lock()
        _live.add(self)

    def _drop_after_fork(self) -> None:
        # A client inherited through fork() shares its sockets (and TLS state) with the parent: abandon
        # it without closing, which would disturb the parent's connections. The parent's lock may have
        # been held by one of its threads at that moment: nobody here would ever release it.
        self._client, self._client_lock = None, threading.Lock()

    def _http(self) -> httpx.Client:
        with self._client_lock:
            if self._client is None:
                self._client = httpx.Client(timeout=self.timeout, follow_redirects=False)
            return self._client

    def close(self) -> None:
        """Close the connection pool; the next request opens a new one."""
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _scrub(self, text: str, personal: tuple[str, ...] = ()) -> str:
        raise NotImplementedError

    def _clip(self, name: object, text: object, personal: tuple[str, ...]) -> tuple[str, str]:
        """An error's name and text, scrubbed of credentials and ``personal`` before white space is collapsed and
        the text cut (a subject quoted with two spaces, or cut in the middle, would no longer match)."""
        clean = self._scrub(str(text)[:SCRUB_WINDOW], personal)
        return self._scrub(str(name), personal)[:100], " ".join(clean.split())[:MAX_ERROR_TEXT]

    @property
    def log(self) -> logging.Logger:
        """The logger of the concrete provider's module (``idemmail_celery.providers.sendgrid``, ...)."""
        return logging.getLogger(type(self).__module__)

    def _accepted_without_id(self, response: httpx.Response, key: str, personal: tuple[str, ...] = ()) -> SendResult:
        # Accepted all the same: raising would make the caller treat something that went out as failed.
        self.log.warning("%s accepted the message for %s but its answer has no message id (HTTP %s)",
                       self.name, logsafe(key), response.status_code)
        return SendResult(message_id="", provider=self.name, request_id=self._request_id(response),
                          extra={"response": self._scrub(response.text[:SCRUB_WINDOW], personal)[:MAX_ERROR_TEXT]})

    def _request_id(self, response: httpx.Response) -> str | None:
        """The provider's id for the request, from the first of :data:`REQUEST_ID_HEADERS` it answered with."""
        return next((response.headers[h] for h in REQUEST_ID_HEADERS if h in response.headers), None)


_live: weakref.WeakSet[HTTPClientProvider] = weakref.WeakSet()


@after_fork
def _drop_clients() -> None:
    for provider in list(_live):
        provider._drop_after_fork()


def unbound(response: httpx.Response) -> httpx.Response:
    """``response`` (already read), its stream replaced by its content.

    httpx binds the stream to the response, a reference cycle holding the request body until the cyclic
    garbage collector's seldom run (issue 35: pool children kept several 10 MiB messages each).
    """
    response.stream = httpx.ByteStream(response.content)
    return response


def transport_error(
    exc: httpx.HTTPError, where: str, key: str, scrub: Callable[[str], str], *, search: bool = False
) -> SendError:
    """The contract's error for a request that got no HTTP answer (a ``search`` is never ambiguous).

    Raise it ``from None``: the httpx exception holds the request, credentials included.
    """
    if isinstance(exc, _CONNECT_ERRORS):
        return TransientSendError(scrub(f"cannot connect to {where}: {exc}"), "connect", key)
    if search:
        return TransientSendError(scrub(f"searching {where} failed: {exc!r}"), "search_failed", key)
    if isinstance(exc, httpx.TimeoutException):  # reading or writing: the connect and pool timeouts are above
        return AmbiguousSendError(scrub(f"{where} timed out: {exc!r}"), "timeout", key)
    if isinstance(exc, _DROPPED_ERRORS):
        return AmbiguousSendError(scrub(f"connection to {where} dropped before a response: {exc!r}"),
                                  "connection_dropped", key)
    # Any other transport failure happened with the request possibly on the wire.
    return AmbiguousSendError(scrub(f"{where} failed: {exc!r}"), "transport_error", key)


def json_body(response: httpx.Response) -> Any:
    """The answer's JSON, or None when it is not JSON."""
    try:
        return response.json()
    except ValueError:
        return None


def find_secret(api_key: str | None, env_vars: Iterable[str]) -> str | None:
    """``api_key``, else the first of ``env_vars`` that is set and not empty."""
    return api_key or next((os.environ[v] for v in env_vars if os.environ.get(v)), None)


def describe_answer(who: str, status: int, name: str, text: str) -> str:
    """``"<who> answered <status> (<name>): <text>"``, leaving out what is empty."""
    return f"{who} answered {status}" + (f" ({name})" if name else "") + (f": {text}" if text else "")


def scrub(text: str, secrets: Iterable[str], mark: str) -> str:
    """``text`` with every non-empty one of ``secrets`` replaced by ``mark``, and no address left in it."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, mark)
    return redact(text)


def user_agent() -> str:
    """The ``User-Agent`` sent with every request: this package's version and httpx's."""
    try:
        version = metadata.version("idemmail-celery")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"idemmail-celery/{version} (+httpx/{httpx.__version__})"


def retry_after(response: httpx.Response) -> float | None:
    """``Retry-After`` in seconds (a number or an HTTP date), or None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def split_url(url: str, what: str) -> tuple[SplitResult, int | None]:
    """``url`` split, and its port; :class:`ConfigurationError` ("bad ``what``") when it cannot be read."""
    try:
        parts = urlsplit(url)
        return parts, parts.port
    except ValueError as exc:
        raise ConfigurationError(f"bad {what}: {exc}") from None


def netloc(host: str, port: int | None) -> str:
    """``host[:port]`` for a URL, an IPv6 address in brackets."""
    return (f"[{host}]" if ":" in host else host) + (f":{port}" if port is not None else "")


class KeylessHTTPProvider(HTTPClientProvider):
    """Base of the JSON-over-HTTPS providers that do not de-duplicate: Postmark, SendGrid, SES.

    Subclasses say where to send (:meth:`_default_base_url`, :meth:`_build`), how to authenticate
    (:meth:`_authorize`) and how to read an acceptance (:meth:`_result`); this class maps errors.
    """

    accepts_idempotency_key = False
    writes_ahead = True
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
        secret = find_secret(api_key, self.api_key_env_vars)
        if not secret:
            raise ConfigurationError(
                f"the {self.name} provider needs credentials: set idemmail_provider_api_key (api_key=) "
                f"or {' / '.join(self.api_key_env_vars)}"
            )
        self.__secret = secret
        read = _seconds(timeout if timeout is not None else query.get("timeout"), 10.0, "timeout")
        connect = _seconds(connect_timeout if connect_timeout is not None else query.get("connect_timeout"),
                           5.0, "connect_timeout")
        super().__init__(httpx.Timeout(read, connect=connect, pool=connect))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, api_key=<hidden>)"

    __str__ = __repr__

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

    def _result(self, response: httpx.Response, key: str, personal: tuple[str, ...] = ()) -> SendResult:
        """Read an accepted send's answer (``personal``: the texts to scrub from anything it quotes)."""
        raise NotImplementedError

    def _secrets(self, secret: str) -> tuple[str, ...]:
        """The parts of the credential that must never be shown (all of it, by default)."""
        return (secret,)

    @scrubbed
    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """Send ``message`` once, tagged with ``key`` (header and provider metadata)."""
        if not key:
            raise PermanentSendError(f"the {self.name} provider needs the intent key to tag the message", "missing_key")
        path, payload = self._build(message, key)
        body = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        about_to_send("request")  # the write-ahead mark: a worker killed before it sent nothing
        response = self._call("POST", path, key, content=body)
        personal = message.personal_texts()
        self._check(response, key, personal=personal)
        return self._result(response, key, personal)

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
        try:
            return unbound(client.send(request))
        except httpx.HTTPError as exc:
            # "from None": the httpx exception holds the request, credentials included.
            raise transport_error(exc, f"{self.name} at {self.base_url}", key, self._scrub, search=search) from None

    def _check(self, response: httpx.Response, key: str, *, search: bool = False,
               personal: tuple[str, ...] = ()) -> None:
        """Raise the contract's error for a non-2xx answer (for a search, always ``TransientSendError``)."""
        status = response.status_code
        if 200 <= status < 300:
            return
        name, text = self._error_detail(response, personal)
        detail = describe_answer(self.name, status, name, text)
        throttled = any(word in name for word in ("Throttl", "TooManyRequests", "LimitExceeded"))
        if status in (401, 403):
            self._log_auth_once(status)
            raise TransientSendError(detail, "auth", key)
        if status == 429 or throttled:
            raise TransientSendError(detail, "rate_limited", key, retry_after(response))
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

    def _error_detail(self, response: httpx.Response, personal: tuple[str, ...] = ()) -> tuple[str, str]:
        """The provider's error name and message (any of the three shapes), scrubbed (see :meth:`_clip`)."""
        name = response.headers.get("x-amzn-errortype", "").split(":", 1)[0]
        data = json_body(response)
        if isinstance(data, Mapping):
            if "ErrorCode" in data and not name:
                name = f"ErrorCode {data['ErrorCode']}"
            text = data.get("Message") or data.get("message") or ""
            errors = data.get("errors")
            if isinstance(errors, list):
                text = "; ".join(str(e.get("message", "")) for e in errors if isinstance(e, Mapping)) or text
        else:
            text = response.text
        return self._clip(name, text, personal)

    def _scrub(self, text: str, personal: tuple[str, ...] = ()) -> str:
        return redact(scrub(text, self._secrets(self.__secret), "<credential>"), personal)

    def _log_auth_once(self, status: int) -> None:
        if not first_time(f"auth:{self.name}"):
            return
        self.log.error(
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


def tagged_headers(message: EmailMessage, key: str) -> list[tuple[str, str]]:
    """The message's headers, sorted, plus ``X-Idemmail-Key: key`` (replacing any header of that name)."""
    kept = [(name, value) for name, value in sorted(message.headers.items()) if name.lower() != KEY_HEADER.lower()]
    return [*kept, (KEY_HEADER, key)]


def _base_url(url: str) -> str:
    """``url`` without a trailing slash, or :class:`ConfigurationError` (http:// only for loopback)."""
    parts, port = split_url(url, "base_url")
    scheme = parts.scheme.lower()
    host = parts.hostname
    if scheme not in ("https", "http") or not host:
        raise ConfigurationError(f"base_url must be https://host[:port][/path], got {url!r}")
    if "@" in parts.netloc:
        raise ConfigurationError("put credentials in idemmail_provider_api_key, not the URL")
    if scheme == "http" and not is_loopback(host):
        raise ConfigurationError(f"http:// would send credentials in clear text to {host}; use https://")
    return urlunsplit(SplitResult(scheme, netloc(host, port), parts.path.rstrip("/"), "", ""))


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
