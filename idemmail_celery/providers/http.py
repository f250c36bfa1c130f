"""The Resend-compatible HTTP provider (``resend://``, ``https://host/path``), de-duplicated by ``Idempotency-Key``.

The body is built deterministically, so a retry under the same key is byte-identical; the status mapping, and
where the API key comes from (never the URL, never a log line): docs/providers.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, urlunsplit

import httpx

from ..email import EmailMessage
from ..errors import (
    AmbiguousSendError,
    ConfigurationError,
    PermanentSendError,
    SendNeedsReview,
    TransientSendError,
)
from ..redaction import scrub as redact
from ..redaction import scrubbed
from ._http import (
    HTTPClientProvider,
    describe_answer,
    find_secret,
    json_body,
    netloc,
    retry_after,
    scrub,
    split_url,
    transport_error,
    unbound,
)
from .base import SendResult, first_time, is_loopback

__all__ = ["RESEND_API_URL", "HTTPProvider", "build_request_body"]

logger = logging.getLogger(__name__)

RESEND_API_URL = "https://api.resend.com/emails"
API_KEY_ENV_VARS = ("IDEMMAIL_PROVIDER_API_KEY", "RESEND_API_KEY")
#: Wait suggested to a caller when the provider says the same key is still being processed.
IN_FLIGHT_RETRY_AFTER = 1.0


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


class HTTPProvider(HTTPClientProvider):
    """Sends through a Resend-compatible HTTP API; ``http://`` only to loopback, an empty path means ``/emails``.

    ``timeout`` bounds reading and writing, ``connect_timeout`` connecting and waiting for a pooled connection.
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
        key = find_secret(api_key, API_KEY_ENV_VARS)
        if not key:
            raise ConfigurationError(
                "the HTTP email provider needs an API key: set idemmail_provider_api_key (api_key=) "
                f"or one of the environment variables {', '.join(API_KEY_ENV_VARS)}"
            )
        self.__api_key = key
        super().__init__(httpx.Timeout(timeout, connect=connect_timeout, pool=connect_timeout))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, api_key=<hidden>)"

    __str__ = __repr__

    @scrubbed
    def send(self, message: EmailMessage, *, key: str) -> SendResult:
        """POST ``message`` once under ``key``; a retry with the same key sends the same bytes."""
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
        try:
            response = unbound(self._http().post(self.url, content=body, headers=headers))
        except httpx.HTTPError as exc:
            # "from None": the httpx exception holds the request, Authorization header included.
            raise transport_error(exc, self.url, key, self._scrub) from None
        return self._outcome(response, key, message.personal_texts())

    def _outcome(self, response: httpx.Response, key: str, personal: tuple[str, ...] = ()) -> SendResult:
        status = response.status_code
        if 200 <= status < 300:
            return self._result(response, key, personal)
        name, text = self._error_detail(response, personal)
        detail = describe_answer(self.url, status, name, text)
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
                wait = retry_after(response)
                wait = IN_FLIGHT_RETRY_AFTER if wait is None else wait
                # The provider is still working on this key: it may yet deliver. Ambiguous, not
                # transient, so a run that exhausts its retries parks it for review, never "failed".
                raise AmbiguousSendError(detail, "provider_in_flight", key, wait)
            if name == "invalid_idempotent_request":
                raise SendNeedsReview(detail, "key_payload_mismatch", key)
            raise PermanentSendError(detail, "http_409", key)
        if status == 429:
            raise TransientSendError(detail, "rate_limited", key, retry_after(response))
        if 400 <= status < 500:
            raise PermanentSendError(detail, f"http_{status}", key)
        # 5xx, and anything else unexpected: the request was delivered and we cannot tell what became of it.
        raise AmbiguousSendError(detail, f"http_{status}", key)

    def _result(self, response: httpx.Response, key: str, personal: tuple[str, ...] = ()) -> SendResult:
        data = json_body(response)
        message_id = data.get("id") if isinstance(data, Mapping) else None
        if isinstance(message_id, str) and message_id:
            return SendResult(message_id=message_id, provider=self.name, request_id=self._request_id(response))
        return self._accepted_without_id(response, key, personal)

    def _error_detail(self, response: httpx.Response, personal: tuple[str, ...] = ()) -> tuple[str, str]:
        """The provider's error name (``name`` or ``type``) and message, scrubbed (see :meth:`_clip`)."""
        data = json_body(response)
        if isinstance(data, Mapping):
            error = data.get("error")
            source: Mapping[str, Any] = error if isinstance(error, Mapping) else data
            name = source.get("name") or source.get("type") or ""
            text = source.get("message") or (error if isinstance(error, str) else "") or ""
        else:
            name, text = "", response.text
        return self._clip(name, text, personal)

    def _scrub(self, text: str, personal: tuple[str, ...] = ()) -> str:
        return redact(scrub(text, (self.__api_key,), "<api key>"), personal)

    def _log_auth_once(self, status: int) -> None:
        if not first_time("auth:http"):
            return
        logger.error(
            "provider rejected the API key (HTTP %s from %s); nothing was sent. "
            "Check idemmail_provider_api_key or %s; sends are retried within their budget meanwhile.",
            status, self.url, " / ".join(API_KEY_ENV_VARS),
        )


def _endpoint(url: str) -> str:
    """The URL to POST to, or :class:`ConfigurationError`."""
    parts, port = split_url(url, "provider URL")
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
    if scheme == "http" and not is_loopback(host):
        raise ConfigurationError(
            f"http:// would send the API key in clear text to {host}; use https:// (http:// is for loopback tests)"
        )
    path = parts.path if parts.path not in ("", "/") else "/emails"
    return urlunsplit(SplitResult(scheme, netloc(host, port), path, parts.query, ""))
