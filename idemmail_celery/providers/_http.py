"""What the providers built on httpx share: Resend-compatible (:mod:`.http`) and keyless (:mod:`._keyless`).

* :class:`HTTPClientProvider`, a provider base holding one ``httpx.Client``, created
  lazily and anew after ``fork()``;
* :func:`unbound`, which lets a read response go of the request body as soon as nobody
  refers to it;
* :func:`transport_error`, which maps a failed request (no HTTP answer at all)
  onto the provider contract (:mod:`.base`);
* :func:`scrub`, which keeps credentials out of messages built from what a server
  or httpx said;
* the small helpers both use to read an answer (:func:`retry_after`) and to
  check and rebuild a URL (:func:`split_url`, :func:`netloc`).
"""

from __future__ import annotations

import email.utils
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from importlib import metadata
from urllib.parse import SplitResult, urlsplit

import httpx

from .._common import after_fork
from ..errors import AmbiguousSendError, ConfigurationError, SendError, TransientSendError
from ..redaction import scrub as redact
from .base import Provider

#: Response headers that may carry the provider's request id, in order of preference.
REQUEST_ID_HEADERS = ("x-request-id", "request-id", "x-resend-request-id", "x-amzn-requestid")
#: How much of a server's error text goes into an exception or a stored result.
MAX_ERROR_TEXT = 500

# Failures before any connection existed: no byte of the request left this process.
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ProxyError)
_DROPPED_ERRORS = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


class HTTPClientProvider(Provider):
    """A provider sending through one pooled ``httpx.Client``; safe to share between threads and across ``fork()``.

    Subclasses call ``super().__init__(timeout)`` once their settings are checked,
    and get the client from :meth:`_http` for each request.
    """

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

    def _request_id(self, response: httpx.Response) -> str | None:
        """The provider's id for the request, from the first of :data:`REQUEST_ID_HEADERS` it answered with."""
        return next((response.headers[h] for h in REQUEST_ID_HEADERS if h in response.headers), None)


_live: weakref.WeakSet[HTTPClientProvider] = weakref.WeakSet()


@after_fork
def _drop_clients() -> None:
    for provider in list(_live):
        provider._drop_after_fork()


def unbound(response: httpx.Response) -> httpx.Response:
    """``response`` (read: ``send`` without ``stream=True``), its stream no longer bound to it.

    httpx binds a response's stream to the response (for ``elapsed``): a reference cycle, and through
    ``response.request`` it holds the request body. A cycle is freed only by the cyclic garbage
    collector, whose oldest generation runs seldom: pool children kept 4 to 7 requests of a 10 MiB
    message each (issue 35). The stream has nothing left to give once the response is read; its
    content takes its place, so the response and its request are freed with the last reference to them.
    """
    response.stream = httpx.ByteStream(response.content)
    return response


def transport_error(
    exc: httpx.HTTPError, where: str, key: str, scrub: Callable[[str], str], *, search: bool = False
) -> SendError:
    """The contract's error for a request to ``where`` that got no HTTP answer, its text passed through ``scrub``.

    Raise it ``from None``: an httpx exception holds the request, credentials
    included, and error reporters that walk ``__cause__`` would carry it along.
    A ``search`` sends nothing, so its failure is never ambiguous.
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


def scrub(text: str, secrets: Iterable[str], mark: str) -> str:
    """``text`` with every non-empty one of ``secrets`` replaced by ``mark``, and no address left in it.

    A provider (or a proxy in front of it) may echo a credential in an error, and quote the
    recipient (a 422: "invalid 'to' address ann@..."); the subject and display names, which
    only the message knows, are scrubbed by :func:`~idemmail_celery.redaction.scrubbed`.
    """
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
