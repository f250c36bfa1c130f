"""Postmark (``postmark://``); the keyless approach it shares with SendGrid and SES (tag, search, webhook), its
URL, credentials and error mapping: docs/providers.md, "Postmark, SendGrid and SES".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import httpx

from .._common import logsafe
from ..chain import KEY_TAG
from ..email import EmailMessage
from ..errors import AmbiguousSendError
from ._http import KEY_HEADER, KeylessHTTPProvider, json_body, tagged_headers
from .base import SendResult

__all__ = ["KEY_HEADER", "KEY_TAG", "POSTMARK_API_URL", "KeylessHTTPProvider", "PostmarkProvider"]

logger = logging.getLogger(__name__)

POSTMARK_API_URL = "https://api.postmarkapp.com"


class PostmarkProvider(KeylessHTTPProvider):
    """Sends through Postmark's ``POST /email``; searches ``GET /messages/outbound`` by metadata."""

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
        data = json_body(response)
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
        """The message under metadata ``idemmail_key == key``, or None (the index lags: no proof of absence).

        ``TransientSendError`` when Postmark cannot be asked.
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
