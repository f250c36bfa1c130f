"""Amazon SES (``ses://REGION``): the SES v2 HTTP API, signed with AWS Signature Version 4 (:func:`sign_v4`).

SES cannot be searched, so :meth:`SESProvider.find_sent` returns None and events confirm parked sends.
URL, credentials and error mapping: docs/providers.md, "Postmark, SendGrid and SES".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

import httpx

from ..chain import KEY_TAG
from ..email import EmailMessage
from ..errors import ConfigurationError, PermanentSendError
from ._http import KeylessHTTPProvider, json_body, tagged_headers
from .base import SendResult

__all__ = ["AWSCredentials", "SESProvider", "sign_v4"]

ALGORITHM = "AWS4-HMAC-SHA256"
_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d+$")
_TAG_TEXT = re.compile(r"^[A-Za-z0-9_-]{1,256}$")


@dataclass(frozen=True)
class AWSCredentials:
    """An access key pair, and a session token for temporary credentials."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None

    def __repr__(self) -> str:
        return f"AWSCredentials(access_key_id={self.access_key_id!r}, secret_access_key=<hidden>)"

    @classmethod
    def parse(cls, text: str) -> AWSCredentials:
        """``ACCESS_KEY_ID:SECRET_ACCESS_KEY[:SESSION_TOKEN]``, or :class:`ConfigurationError`."""
        parts = text.split(":", 2)
        if len(parts) < 2 or not parts[0] or not parts[1]:
            raise ConfigurationError('SES credentials must look like "ACCESS_KEY_ID:SECRET_ACCESS_KEY"')
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 and parts[2] else None)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode("utf-8"), hashlib.sha256).digest()


def _encode(text: str) -> str:
    return quote(text, safe="-_.~")


def sign_v4(
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes,
    *,
    credentials: AWSCredentials,
    region: str,
    service: str,
) -> str:
    """The ``Authorization`` header value for a request, by AWS Signature Version 4.

    Every header in ``headers`` is signed, and they must include ``host`` and ``x-amz-date``
    (``YYYYMMDDTHHMMSSZ``, UTC) as sent; the body is hashed into the signature.
    """
    parts = urlsplit(url)
    lowered = {name.lower(): " ".join(str(value).split()) for name, value in headers.items()}
    amz_date = lowered.get("x-amz-date", "")
    if "host" not in lowered or len(amz_date) != 16:
        raise ValueError("sign_v4 needs the host and x-amz-date headers")
    signed = ";".join(sorted(lowered))
    query = "&".join(f"{_encode(k)}={_encode(v)}"
                     for k, v in sorted(parse_qsl(parts.query, keep_blank_values=True)))
    canonical = "\n".join([
        method.upper(),
        quote(unquote(parts.path or "/"), safe="/-_.~"),
        query,
        "".join(f"{name}:{lowered[name]}\n" for name in sorted(lowered)),
        signed,
        hashlib.sha256(body).hexdigest(),
    ])
    scope = f"{amz_date[:8]}/{region}/{service}/aws4_request"
    to_sign = "\n".join([ALGORITHM, amz_date, scope, hashlib.sha256(canonical.encode("utf-8")).hexdigest()])
    key = ("AWS4" + credentials.secret_access_key).encode("utf-8")
    for part in (amz_date[:8], region, service, "aws4_request"):
        key = _hmac(key, part)
    signature = hmac.new(key, to_sign.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"{ALGORITHM} Credential={credentials.access_key_id}/{scope}, SignedHeaders={signed}, Signature={signature}"


class SESProvider(KeylessHTTPProvider):
    """Sends through SES v2 ``POST /v2/email/outbound-emails`` (a Simple message), signed with SigV4."""

    name = "ses"
    schemes = ("ses",)
    api_key_env_vars = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    url_options = ("configuration_set",)

    def __init__(self, url: str, *, api_key: str | None = None, **options: Any) -> None:
        if not api_key:
            env = os.environ
            if not (env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")):
                raise ConfigurationError(
                    'the ses provider needs credentials: api_key="ACCESS_KEY_ID:SECRET_ACCESS_KEY" '
                    "(idemmail_provider_api_key) or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
                )
            api_key = ":".join(p for p in (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"],
                                           env.get("AWS_SESSION_TOKEN", "")) if p)
        AWSCredentials.parse(api_key)  # fail at construction, not at the first send
        super().__init__(url, api_key=api_key, **options)

    def _configure(self, host: str, options: Mapping[str, str]) -> None:
        region = host or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or ""
        if not _REGION.match(region):
            raise ConfigurationError(f"ses:// needs a region, e.g. ses://eu-west-1; got {region!r}")
        self.region = region
        self.configuration_set = options.get("configuration_set") or None

    def _default_base_url(self) -> str:
        return f"https://email.{self.region}.amazonaws.com"

    def _secrets(self, secret: str) -> tuple[str, ...]:
        credentials = AWSCredentials.parse(secret)
        return tuple(p for p in (credentials.secret_access_key, credentials.session_token) if p)

    def _authorize(self, request: httpx.Request, secret: str) -> None:
        credentials = AWSCredentials.parse(secret)
        request.headers["X-Amz-Date"] = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        if credentials.session_token:
            request.headers["X-Amz-Security-Token"] = credentials.session_token
        signed = {name: request.headers[name] for name in ("host", "x-amz-date", "content-type",
                                                           "x-amz-security-token") if name in request.headers}
        request.headers["Authorization"] = sign_v4(request.method, str(request.url), signed, request.content,
                                                   credentials=credentials, region=self.region, service="ses")

    def _build(self, message: EmailMessage, key: str) -> tuple[str, dict[str, Any]]:
        # SES refuses other characters in tags with a 400; say which tag before sending anything.
        for name, value in (*message.tags.items(), (KEY_TAG, key)):
            if not (_TAG_TEXT.match(name) and _TAG_TEXT.match(value)):
                raise PermanentSendError(
                    f"SES message tags take only letters, digits, '_' and '-' (tag {name!r})", "rejected", key)
        simple: dict[str, Any] = {
            "Subject": {"Data": message.subject, "Charset": "UTF-8"},
            "Body": {kind: {"Data": value, "Charset": "UTF-8"}
                     for kind, value in (("Text", message.text), ("Html", message.html)) if value is not None},
            "Headers": [{"Name": name, "Value": value} for name, value in tagged_headers(message, key)],
        }
        if message.attachments:
            simple["Attachments"] = [
                {"FileName": a["filename"], "RawContent": a["content_b64"], "ContentType": a["content_type"],
                 "ContentDisposition": "ATTACHMENT"}
                for a in message.to_payload()["attachments"]
            ]
        destination = {field: list(addresses) for field, addresses in (
            ("ToAddresses", message.to), ("CcAddresses", message.cc), ("BccAddresses", message.bcc)) if addresses}
        body: dict[str, Any] = {
            "FromEmailAddress": message.sender,
            "Destination": destination,
            "Content": {"Simple": simple},
            "EmailTags": [*({"Name": n, "Value": v} for n, v in sorted(message.tags.items()) if n != KEY_TAG),
                          {"Name": KEY_TAG, "Value": key}],
        }
        if message.reply_to:
            body["ReplyToAddresses"] = list(message.reply_to)
        if self.configuration_set:
            body["ConfigurationSetName"] = self.configuration_set
        return "/v2/email/outbound-emails", body

    def _result(self, response: httpx.Response, key: str, personal: tuple[str, ...] = ()) -> SendResult:
        data = json_body(response)
        message_id = data.get("MessageId") if isinstance(data, Mapping) else None
        if isinstance(message_id, str) and message_id:
            return SendResult(message_id=message_id, provider=self.name, request_id=self._request_id(response))
        return self._accepted_without_id(response, key, personal)

    # find_sent: inherited, always None. SES has no search; its events settle ambiguous sends.
