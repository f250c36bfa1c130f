"""The Resend-compatible HTTP provider: ``resend://`` and ``https://host/path``.

One ``POST`` of JSON per send, carrying the intent key as ``Idempotency-Key``,
so the provider drops a copy sent again under the same key: an ambiguous
attempt (a timeout, a dropped connection, a 5xx) is safe to retry with the same
key and the same bytes. The body is built deterministically from
:meth:`EmailMessage.to_payload`, so a retry is byte-identical and the provider
never sees "same key, other payload" from us.

Every failure is mapped onto the provider contract
(:mod:`idemmail_celery.providers.base`): :class:`TransientSendError` when
nothing was accepted, :class:`PermanentSendError` when the message was refused
for good, :class:`AmbiguousSendError` when it may have been accepted, and
:class:`SendNeedsReview` when the provider holds another payload under the key.

The API key comes from ``api_key=`` (``idemmail_provider_api_key``), else the
environment variables ``IDEMMAIL_PROVIDER_API_KEY`` or ``RESEND_API_KEY``. It is
never accepted inside the URL and never written to a repr, a log line or an
exception.
"""

from __future__ import annotations

import email.utils
import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from importlib import metadata
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import httpx

from ..email import EmailMessage
from ..errors import (
    AmbiguousSendError,
    ConfigurationError,
    PermanentSendError,
    SendNeedsReview,
    TransientSendError,
)
from .base import Provider, SendResult

__all__ = ["RESEND_API_URL", "HTTPProvider", "build_request_body"]

logger = logging.getLogger(__name__)

RESEND_API_URL = "https://api.resend.com/emails"
API_KEY_ENV_VARS = ("IDEMMAIL_PROVIDER_API_KEY", "RESEND_API_KEY")
REQUEST_ID_HEADERS = ("x-request-id", "request-id", "x-resend-request-id", "x-amzn-requestid")
#: Wait suggested to a caller when the provider says the same key is still being processed.
IN_FLIGHT_RETRY_AFTER = 1.0
_MAX_ERROR_TEXT = 500

# "Once per process", also in forked workers: remember which pid logged.
_auth_logged_pid: int | None = None
_auth_log_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _auth_log_lock
    _auth_log_lock = threading.Lock()  # a parent thread may have held it at fork()


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _user_agent() -> str:
    try:
        version = metadata.version("idemmail-celery")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"idemmail-celery/{version} (+httpx/{httpx.__version__})"


def build_request_body(message: EmailMessage) -> bytes:
    """The exact bytes POSTed for ``message``: Resend's JSON shape, canonical and compact.

    Empty fields are left out; tags are sorted by name and attachment order is
    kept, so the same message always gives the same bytes.
    """
    payload = message.to_payload()
    body: dict[str, Any] = {"from": payload["from"], "subject": payload["subject"]}
    for field in ("to", "cc", "bcc", "reply_to"):
        if payload[field]:
            body[field] = list(payload[field])
    for field in ("html", "text"):
        if payload[field] is not None:
            body[field] = payload[field]
    if payload["headers"]:
        body["headers"] = dict(payload["headers"])
    if payload["tags"]:
        body["tags"] = [{"name": name, "value": value} for name, value in sorted(payload["tags"].items())]
    if payload["attachments"]:
        body["attachments"] = [
            {"filename": a["filename"], "content": a["content_b64"], "content_type": a["content_type"]}
            for a in payload["attachments"]
        ]
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


class HTTPProvider(Provider):
    """Sends through a Resend-compatible HTTP API, de-duplicated by ``Idempotency-Key``.

    ``url`` is ``resend://`` (Resend's own API) or ``https://host[:port]/path``
    (an empty path means ``/emails``); ``http://`` is accepted only for loopback
    hosts, for tests. ``timeout`` bounds reading and writing, ``connect_timeout``
    bounds connecting and waiting for a pooled connection. Raises
    :class:`ConfigurationError` for a bad URL, an API key inside the URL, or no
    API key at all. Safe to share between threads and across ``fork()``.
    """

    name = "resend"
    accepts_idempotency_key = True

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        connect_timeout: float = 5.0,
        **_: Any,
    ) -> None:
        self.url = _endpoint(url)
        key = api_key or next((os.environ[v] for v in API_KEY_ENV_VARS if os.environ.get(v)), None)
        if not key:
            raise ConfigurationError(
                "the HTTP email provider needs an API key: set idemmail_provider_api_key (api_key=) "
                f"or one of the environment variables {', '.join(API_KEY_ENV_VARS)}"
            )
        self.__api_key = key
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout, pool=connect_timeout)
        self._user_agent = _user_agent()
        self._client: httpx.Client | None = None
        self._client_pid: int | None = None
        self._client_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, api_key=<hidden>)"

    __str__ = __repr__

    # -- the connection pool --

    def _http(self) -> httpx.Client:
        pid = os.getpid()
        if self._client_pid is not None and self._client_pid != pid:
            # First use after fork(): the inherited lock may be held by a parent thread that does
            # not exist here. At worst two child threads each build a client and one is dropped.
            self._client_lock = threading.Lock()
        with self._client_lock:
            if self._client is None or self._client_pid != pid:
                # A client inherited through fork() shares its sockets (and TLS state) with the
                # parent: abandon it without closing, which would disturb the parent's connections.
                self._client = httpx.Client(timeout=self.timeout, follow_redirects=False)
                self._client_pid = pid
            return self._client

    def close(self) -> None:
        """Close the connection pool; the next send opens a new one."""
        with self._client_lock:
            client, self._client = self._client, None
            if client is not None and self._client_pid == os.getpid():
                client.close()

    # -- sending --

    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """POST ``message`` once under ``key``; a retry with the same key sends the same bytes.

        Returns the provider's message id. Raises ``TransientSendError`` (connect
        failed, auth refused, rate limited, the key still in flight),
        ``PermanentSendError`` (rejected), ``AmbiguousSendError`` (5xx, timeout or
        connection lost after the request was written: retry with the same key)
        or ``SendNeedsReview`` (the provider holds another payload under the key).
        """
        if not key:
            raise PermanentSendError("the HTTP provider needs the intent key to send", "missing_key")
        body = build_request_body(message)
        headers = {
            "Authorization": f"Bearer {self.__api_key}",
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            "User-Agent": self._user_agent,
            "Accept": "application/json",
        }
        # Errors are raised "from None": an httpx exception holds the request, Authorization header included,
        # and error reporters that walk __cause__ would carry it along.
        try:
            response = self._http().post(self.url, content=body, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.ProxyError) as exc:
            # No connection was made, so no byte of the request left this process.
            raise TransientSendError(self._scrub(f"cannot connect to {self.url}: {exc}"), "connect", key) from None
        except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
            raise AmbiguousSendError(self._scrub(f"{self.url} timed out: {exc!r}"), "timeout", key) from None
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
            raise AmbiguousSendError(
                self._scrub(f"connection to {self.url} dropped before a response: {exc!r}"), "connection_dropped", key
            ) from None
        except httpx.HTTPError as exc:
            # Any other transport failure happened with the request possibly on the wire.
            raise AmbiguousSendError(self._scrub(f"{self.url} failed: {exc!r}"), "transport_error", key) from None
        return self._outcome(response, key)

    def _outcome(self, response: httpx.Response, key: str) -> SendResult:
        status = response.status_code
        if 200 <= status < 300:
            return self._result(response)
        name, text = self._error_detail(response)
        detail = f"{self.url} answered {status}" + (f" ({name})" if name else "") + (f": {text}" if text else "")
        if status in (400, 422):
            raise PermanentSendError(detail, "rejected", key)
        if status in (401, 403):
            self._log_auth_once(status)
            raise TransientSendError(detail, "auth", key)
        if status == 408:
            # The server gave up waiting for our request: it did not process it.
            raise TransientSendError(detail, "request_timeout", key)
        if status == 409:
            if name == "concurrent_idempotent_requests":
                wait = _retry_after(response)
                wait = IN_FLIGHT_RETRY_AFTER if wait is None else wait
                raise TransientSendError(detail, "provider_in_flight", key, wait)
            if name == "invalid_idempotent_request":
                raise SendNeedsReview(detail, "key_payload_mismatch", key)
            raise PermanentSendError(detail, "http_409", key)
        if status == 429:
            raise TransientSendError(detail, "rate_limited", key, _retry_after(response))
        if 400 <= status < 500:
            raise PermanentSendError(detail, f"http_{status}", key)
        # 5xx, and anything else unexpected: the request was delivered and we cannot tell what became of it.
        raise AmbiguousSendError(detail, f"http_{status}", key)

    def _result(self, response: httpx.Response) -> SendResult:
        request_id = next((response.headers[h] for h in REQUEST_ID_HEADERS if h in response.headers), None)
        try:
            data = response.json()
        except ValueError:
            data = None
        message_id = data.get("id") if isinstance(data, Mapping) else None
        if isinstance(message_id, str) and message_id:
            return SendResult(message_id=message_id, provider=self.name, request_id=request_id)
        # Accepted all the same: raising would make the caller retry something that went out.
        logger.warning("%s accepted the message but its response has no id (HTTP %s)", self.url, response.status_code)
        text = self._scrub(response.text[:_MAX_ERROR_TEXT])
        return SendResult(message_id="", provider=self.name, request_id=request_id, extra={"response": text})

    def _error_detail(self, response: httpx.Response) -> tuple[str, str]:
        """The provider's error name (``name`` or ``type``) and message, with the API key scrubbed."""
        try:
            data = response.json()
        except ValueError:
            data = None
        if isinstance(data, Mapping):
            error = data.get("error")
            source: Mapping[str, Any] = error if isinstance(error, Mapping) else data
            name = source.get("name") or source.get("type") or ""
            text = source.get("message") or (error if isinstance(error, str) else "") or ""
        else:
            name, text = "", response.text
        return self._scrub(str(name))[:100], self._scrub(" ".join(str(text).split()))[:_MAX_ERROR_TEXT]

    def _scrub(self, text: str) -> str:
        # A provider (or a proxy in front of it) may echo the Authorization header in an error.
        return text.replace(self.__api_key, "<api key>")

    def _log_auth_once(self, status: int) -> None:
        global _auth_logged_pid
        with _auth_log_lock:
            if _auth_logged_pid == os.getpid():
                return
            _auth_logged_pid = os.getpid()
        logger.error(
            "provider rejected the API key (HTTP %s from %s); nothing was sent. "
            "Check idemmail_provider_api_key or %s; sends are retried within their budget meanwhile.",
            status, self.url, " / ".join(API_KEY_ENV_VARS),
        )


def _endpoint(url: str) -> str:
    """The URL to POST to, or :class:`ConfigurationError`."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigurationError(f"bad provider URL: {exc}") from None
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ConfigurationError("put the API key in idemmail_provider_api_key, not the URL")
    scheme = parts.scheme.lower()
    if scheme == "resend":
        return RESEND_API_URL
    if scheme not in ("https", "http"):
        raise ConfigurationError(f"the HTTP provider takes resend://, https:// or http:// URLs, not {scheme}://")
    host = parts.hostname
    if not host:
        raise ConfigurationError("the provider URL has no host")
    if scheme == "http" and not _is_loopback(host):
        raise ConfigurationError(
            f"http:// would send the API key in clear text to {host}; use https:// (http:// is for loopback tests)"
        )
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc += f":{port}"
    path = parts.path if parts.path not in ("", "/") else "/emails"
    return urlunsplit(SplitResult(scheme, netloc, path, parts.query, ""))


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _retry_after(response: httpx.Response) -> float | None:
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
