"""SendGrid (``sendgrid://``): v3 ``POST /v3/mail/send``, reconciled through the Email Activity API.

**SendGrid has no idempotency key**: two requests are two emails. Each message is
tagged with the intent key, as the header ``X-Idemmail-Key`` and as the custom
argument ``idemmail_key`` of its personalization, which SendGrid returns in every
Event Webhook event (top-level, next to ``sg_message_id``) and lets the Email
Activity API filter on. See :mod:`.postmark` for the whole approach.

**Which layer protects you** with SendGrid: the ledger (one claim per intent, at
most one send); then :meth:`SendGridProvider.find_sent`, which searches the Email
Activity API, *only if your account has it* (a paid add-on; without it the
search answers 403/404 and every ambiguous send is parked for review); then the
Event Webhook (``processed``/``delivered``, see :mod:`idemmail_celery.webhooks`).
SendGrid itself de-duplicates nothing.

URL and options::

    sendgrid://[?base_url=https://api.sendgrid.com&timeout=10&connect_timeout=5]

The API key comes from ``api_key=`` (``idemmail_provider_api_key``) or the
environment variable ``SENDGRID_API_KEY``, is sent as a bearer token, and never
appears in a repr, a log line or an exception.

SendGrid answers a send with ``202 Accepted``, an empty body and the header
``X-Message-Id``; that id is what :class:`~idemmail_celery.providers.base.SendResult`
carries. The per-recipient ``sg_message_id`` of webhook events and activity
records *starts with* it. Errors map as in :mod:`.postmark` (SendGrid uses 400,
not 422, for a message it refuses: ``PermanentSendError``, reason ``rejected``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from ..email import EmailMessage, split_address
from ._keyless import KEY_TAG, KeylessHTTPProvider, tagged_headers
from .base import SendResult

__all__ = ["SENDGRID_API_URL", "SendGridProvider", "activity_query"]

SENDGRID_API_URL = "https://api.sendgrid.com"


def activity_query(key: str) -> str:
    """The Email Activity API filter for messages whose custom argument ``idemmail_key`` is ``key``."""
    return f"unique_args['{KEY_TAG}']=\"{key}\""


def _address(text: str) -> dict[str, str]:
    name, addr = split_address(text)
    return {"email": addr, "name": name} if name else {"email": addr}


class SendGridProvider(KeylessHTTPProvider):
    """Sends through SendGrid's v3 Mail Send API; searches the Email Activity API by custom argument.

    ``url`` is ``sendgrid://`` (``base_url=``, ``timeout=``, ``connect_timeout=`` as
    query options or keywords). Raises :class:`ConfigurationError` for a bad URL or
    no API key.
    """

    name = "sendgrid"
    schemes = ("sendgrid",)
    api_key_env_vars = ("SENDGRID_API_KEY",)

    def _default_base_url(self) -> str:
        return SENDGRID_API_URL

    def _authorize(self, request: httpx.Request, secret: str) -> None:
        request.headers["Authorization"] = f"Bearer {secret}"

    def _build(self, message: EmailMessage, key: str) -> tuple[str, dict[str, Any]]:
        personalization: dict[str, Any] = {"custom_args": {KEY_TAG: key}}
        for field, addresses in (("to", message.to), ("cc", message.cc), ("bcc", message.bcc)):
            if addresses:
                personalization[field] = [_address(a) for a in addresses]
        body: dict[str, Any] = {
            "personalizations": [personalization],
            "from": _address(message.sender),
            "subject": message.subject,
            # SendGrid requires text/plain before text/html.
            "content": [{"type": kind, "value": value}
                        for kind, value in (("text/plain", message.text), ("text/html", message.html))
                        if value is not None],
            "headers": dict(tagged_headers(message, key)),
        }
        if len(message.reply_to) == 1:
            body["reply_to"] = _address(message.reply_to[0])
        elif message.reply_to:
            body["reply_to_list"] = [_address(a) for a in message.reply_to]
        if message.tags:
            body["custom_args"] = dict(message.tags)
        if message.attachments:
            body["attachments"] = [
                {"content": a["content_b64"], "filename": a["filename"], "type": a["content_type"],
                 "disposition": "attachment"}
                for a in message.to_payload()["attachments"]
            ]
        return "/v3/mail/send", body

    def _result(self, response: httpx.Response, key: str, personal: tuple[str, ...] = ()) -> SendResult:
        message_id = response.headers.get("x-message-id")
        if message_id:
            return SendResult(message_id=message_id, provider=self.name, request_id=self._request_id(response))
        return self._accepted_without_id(response, key, personal)

    def find_sent(self, key: str) -> SendResult | None:
        """The first activity record tagged ``idemmail_key == key``, or None when there is none (yet).

        Uses ``GET /v3/messages?query=unique_args['idemmail_key']="<key>"&limit=1``.
        The Email Activity API is a paid add-on, lags the send, and is rate limited
        (a handful of requests a minute): None is not proof of absence. Raises
        ``TransientSendError`` when SendGrid cannot be asked (no add-on: ``auth``/
        ``search_failed``; throttled: ``rate_limited``; connect).
        """
        data = self._search("/v3/messages", key, {"query": activity_query(key), "limit": "1"})
        messages = data.get("messages") if isinstance(data, Mapping) else None
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], Mapping):
            return None
        found = messages[0]
        message_id = found.get("msg_id")
        if not isinstance(message_id, str) or not message_id:
            return None
        return SendResult(message_id=message_id, provider=self.name,
                          extra={"found_by": "search", "status": found.get("status")})
