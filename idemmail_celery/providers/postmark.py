"""Postmark (``postmark://``), and how the HTTP providers without an idempotency key stay safe.

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

The machinery the three share, :class:`KeylessHTTPProvider`, lives in
:mod:`._keyless` and is importable from here.

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

import logging
from collections.abc import Mapping
from typing import Any

import httpx

from .._common import logsafe
from ..email import EmailMessage
from ..errors import AmbiguousSendError
from ._keyless import KEY_HEADER, KEY_TAG, KeylessHTTPProvider, tagged_headers
from .base import SendResult

__all__ = ["KEY_HEADER", "KEY_TAG", "POSTMARK_API_URL", "KeylessHTTPProvider", "PostmarkProvider"]

logger = logging.getLogger(__name__)

POSTMARK_API_URL = "https://api.postmarkapp.com"

# Which keyless provider (by name) has logged refused credentials, and in which process: once per
# process and provider, also in forked workers. Kept and used by KeylessHTTPProvider._log_auth_once.


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

    def _result(self, response: httpx.Response, key: str, personal: tuple[str, ...] = ()) -> SendResult:
        try:
            data = response.json()
        except ValueError:
            data = None
        if isinstance(data, Mapping):
            code = data.get("ErrorCode", 0)
            if code not in (0, None):
                # A 2xx that says "error" is not an answer we can trust either way.
                name, text = self._error_detail(response, personal)
                raise AmbiguousSendError(f"postmark answered {response.status_code} with {name}: {text}",
                                         "unexpected_response", key)
            message_id = data.get("MessageID")
            if isinstance(message_id, str) and message_id:
                return SendResult(message_id=message_id, provider=self.name, request_id=self._request_id(response))
        return self._accepted_without_id(response, key, personal)

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
            logger.warning("postmark search for %s returned a message tagged otherwise; ignoring it", logsafe(key))
            return None
        message_id = found.get("MessageID")
        if not isinstance(message_id, str) or not message_id:
            return None
        return SendResult(message_id=message_id, provider=self.name,
                          extra={"found_by": "search", "status": found.get("Status")})
