"""SendGrid (``sendgrid://``): v3 ``POST /v3/mail/send``, reconciled through the Email Activity API.

URL, credentials and error mapping: docs/providers.md, "Postmark, SendGrid and SES".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from ..chain import KEY_TAG
from ..email import EmailMessage, split_address
from ._http import KeylessHTTPProvider, tagged_headers
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
    """Sends through SendGrid's v3 Mail Send API; searches the Email Activity API by custom argument."""

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
        """The first activity record tagged ``idemmail_key == key``, or None (no proof of absence).

        The Email Activity API (a paid add-on) lags the send and allows a handful of requests a minute;
        ``TransientSendError`` when SendGrid cannot be asked.
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
