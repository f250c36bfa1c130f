"""A fake Postmark, SendGrid and Amazon SES on one HTTP server, none de-duplicating (routes: docs/testing.md).

It speaks just enough of each API for the keyless providers (:mod:`idemmail_celery.providers.postmark`,
``.sendgrid``, ``.ses``); searches lag ``search_lag_seconds`` behind sends, on ``clock``.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..providers.ses import AWSCredentials, sign_v4
from ._server import ACCEPT_FAULTS, FakeHTTPServer, Reply

__all__ = [
    "DEFAULT_AWS_ACCESS_KEY_ID", "DEFAULT_AWS_SECRET_ACCESS_KEY", "DEFAULT_POSTMARK_TOKEN", "DEFAULT_SENDGRID_KEY",
    "FAULT_KINDS", "FakeKeylessProvider", "KeylessDelivery", "SeenRequest",
]

DEFAULT_POSTMARK_TOKEN = "pm-fake-server-token"
DEFAULT_SENDGRID_KEY = "SG.fake-sendgrid-key"
DEFAULT_AWS_ACCESS_KEY_ID = "AKIDFAKEKEYLESS"
DEFAULT_AWS_SECRET_ACCESS_KEY = "fake/secret+access/key"

FAULT_KINDS: Mapping[str, str] = {
    **ACCEPT_FAULTS,
    "401": "refuse the credentials (401; SES answers 403 as AWS does), record nothing",
    "422": "refuse the message (Postmark 422 with an ErrorCode; SendGrid and SES use 400), record nothing",
    "429": "answer 429 with Retry-After: 7, record nothing",
}
"""Every fault :meth:`FakeKeylessProvider.fail_next` accepts, and what it does to one send."""

_SEND_ROUTES = {"/email": "postmark", "/v3/mail/send": "sendgrid", "/v2/email/outbound-emails": "ses"}
_AUTHORIZATION = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=(?P<akid>[^/\s]+)/(?P<date>\d{8})/(?P<region>[a-z0-9-]+)/ses/aws4_request, "
    r"SignedHeaders=(?P<signed>[a-z0-9;-]+), Signature=(?P<signature>[0-9a-f]{64})$"
)
_ACTIVITY_QUERY = re.compile(r"^unique_args\['(?P<name>[^']+)'\]=\"(?P<value>[^\"]*)\"$")


@dataclass(frozen=True)
class KeylessDelivery:
    """One message the fake accepted: what the real provider would have sent.

    ``key`` is the intent key as the provider's metadata carries it (Postmark
    ``Metadata``, SendGrid ``custom_args``, SES ``EmailTags``); ``header_key`` is the
    ``X-Idemmail-Key`` header of the email itself.
    """

    provider: str
    key: str | None
    header_key: str | None
    message_id: str
    recipients: tuple[str, ...]
    subject: str
    at: float
    payload: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class SeenRequest:
    """One request as the server saw it; credentials are redacted (a SigV4 header holds none)."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str] = field(repr=False)
    status: int | None = None


def _error(provider: str, status: int, name: str, text: str, headers: dict[str, str] | None = None) -> Reply:
    extra = dict(headers or {})
    if provider == "postmark":
        codes = {401: 10, 422: 300, 429: 429, 500: 500, 503: 503}
        return Reply(status, {"ErrorCode": codes.get(status, status), "Message": text}, extra)
    if provider == "sendgrid":
        return Reply(status, {"errors": [{"message": text, "field": None, "help": name}]}, extra)
    extra["x-amzn-ErrorType"] = name
    return Reply(status, {"message": text}, extra)


_BEFORE_ACCEPT: dict[str, dict[str, tuple[int, str, str]]] = {
    "503_before_accept": {p: (503, "ServiceUnavailable", "service unavailable") for p in _SEND_ROUTES.values()},
    "429": {p: (429, "TooManyRequestsException", "too many requests") for p in _SEND_ROUTES.values()},
    "401": {"postmark": (401, "Unauthorized", "Request does not contain a valid Server token."),
            "sendgrid": (401, "Unauthorized", "The provided authorization grant is invalid, expired, or revoked"),
            "ses": (403, "UnrecognizedClientException", "The security token included in the request is invalid.")},
    "422": {"postmark": (422, "InvalidEmailRequest", "Invalid 'To' address."),
            "sendgrid": (400, "BadRequest", "Does not contain a valid address."),
            "ses": (400, "MessageRejected", "Email address is not verified.")},
}


class FakeKeylessProvider(FakeHTTPServer):
    """Postmark, SendGrid and SES on ``127.0.0.1``, started with :meth:`start` or ``with FakeKeylessProvider() as f:``.

    Point a provider at it with ``base_url=fake.url`` and the matching credential (:attr:`postmark_token`,
    :attr:`sendgrid_api_key`, :attr:`aws_credentials`, whose ``api_key`` form is ``"ACCESS:SECRET"``).
    """

    thread_name = "fake-keyless"
    fault_kinds = FAULT_KINDS
    cut_dropped_connections = True

    def __init__(self, *, postmark_token: str = DEFAULT_POSTMARK_TOKEN, sendgrid_api_key: str = DEFAULT_SENDGRID_KEY,
                 aws_access_key_id: str = DEFAULT_AWS_ACCESS_KEY_ID,
                 aws_secret_access_key: str = DEFAULT_AWS_SECRET_ACCESS_KEY, search_lag_seconds: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, port: int = 0) -> None:
        self.postmark_token = postmark_token
        self.sendgrid_api_key = sendgrid_api_key
        self.aws_credentials = AWSCredentials(aws_access_key_id, aws_secret_access_key)
        self.search_lag_seconds = search_lag_seconds
        self.clock = clock
        super().__init__(port=port)
        self._deliveries: list[KeylessDelivery] = []
        self._delivered: Counter[str | None] = Counter()
        self._requests: list[SeenRequest] = []

    def deliveries(self, provider: str | None = None) -> list[KeylessDelivery]:
        """Every accepted message (of one provider, if given), oldest first."""
        with self._lock:
            return [d for d in self._deliveries if provider is None or d.provider == provider]

    def delivery_count(self, key: str | None = None) -> int:
        """Deliveries in all, or tagged with ``key``: 2 means the intent went out twice."""
        return self._count(self._delivered, key)

    def requests(self) -> list[SeenRequest]:
        """Every request received (sends and searches), oldest first."""
        with self._lock:
            return list(self._requests)

    def _handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Reply | None:
        parts = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        reply = self._route(method, parts.path, query, headers, body)
        seen = {k: _redact(k, v) for k, v in headers.items()}
        with self._lock:
            self._requests.append(SeenRequest(method, parts.path, query, seen, reply.status if reply else None))
        return reply

    def _route(self, method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str],
               body: bytes) -> Reply | None:
        provider = _SEND_ROUTES.get(path)
        if method == "POST" and provider is not None:
            return self._send(provider, path, headers, body)
        if method == "GET" and path == "/messages/outbound":
            return self._authenticate("postmark", path, headers, body) or self._postmark_search(query)
        if method == "GET" and path == "/v3/messages":
            return self._authenticate("sendgrid", path, headers, body) or self._sendgrid_search(query)
        return Reply(404, {"message": f"no route {method} {path}"})

    def _send(self, provider: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply | None:
        fault = self._next_fault()
        if fault in _BEFORE_ACCEPT:
            status, name, text = _BEFORE_ACCEPT[fault][provider]
            return _error(provider, status, name, text, {"Retry-After": "7"} if status == 429 else None)
        refusal = self._authenticate(provider, path, headers, body)
        if refusal is not None:
            return refusal
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            return _error(provider, 422 if provider == "postmark" else 400, "BadRequest", "the body is not JSON")
        problem = _PROBLEMS[provider](data)
        if problem:
            return _error(provider, 422 if provider == "postmark" else 400, "BadRequestException", problem)
        delivery = _DELIVERIES[provider](data, self.clock())
        with self._lock:
            self._deliveries.append(delivery)
            self._delivered[delivery.key] += 1
        if fault == "drop_after_accept":
            return None
        if fault == "500_after_accept":
            return _error(provider, 500, "InternalFailure", "an unexpected error occurred")
        if provider == "postmark":
            return Reply(200, {"To": ", ".join(delivery.recipients), "SubmittedAt": _iso(), "ErrorCode": 0,
                                "MessageID": delivery.message_id, "Message": "OK"})
        if provider == "sendgrid":
            return Reply(202, None, {"X-Message-Id": delivery.message_id})
        return Reply(200, {"MessageId": delivery.message_id}, {"x-amzn-RequestId": str(uuid.uuid4())})

    def _authenticate(self, provider: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply | None:
        if provider == "postmark":
            if not secrets.compare_digest(headers.get("x-postmark-server-token", ""), self.postmark_token):
                return _error("postmark", 401, "Unauthorized", "Request does not contain a valid Server token.")
            return None
        if provider == "sendgrid":
            if not secrets.compare_digest(headers.get("authorization", ""), f"Bearer {self.sendgrid_api_key}"):
                return _error("sendgrid", 401, "Unauthorized", "authorization required")
            return None
        problem = self._sigv4_problem(path, headers, body)
        if problem:
            return _error("ses", 403, "SignatureDoesNotMatch" if "signature" in problem else "IncompleteSignature",
                          problem)
        return None

    def _sigv4_problem(self, path: str, headers: Mapping[str, str], body: bytes) -> str:
        """Why this SES request's signature fails, or ""."""
        match = _AUTHORIZATION.match(headers.get("authorization", ""))
        if match is None:
            return "the Authorization header is not AWS4-HMAC-SHA256 Credential=.../ses/aws4_request, ..."
        if match["akid"] != self.aws_credentials.access_key_id:
            return "the access key id is not known"
        signed = match["signed"].split(";")
        if "host" not in signed or "x-amz-date" not in signed or match["date"] != headers.get("x-amz-date", "")[:8]:
            return "host and x-amz-date must be signed, and the credential date must match x-amz-date"
        if any(name not in headers for name in signed):
            return "a signed header is missing from the request"
        expected = sign_v4("POST", f"http://{headers['host']}{path}", {name: headers[name] for name in signed},
                           body, credentials=self.aws_credentials, region=match["region"], service="ses")
        if not secrets.compare_digest(expected, headers["authorization"]):
            return "the request signature we calculated does not match the signature you provided"
        return ""

    def _searchable(self, provider: str) -> list[KeylessDelivery]:
        horizon = self.clock() - self.search_lag_seconds
        with self._lock:
            return [d for d in reversed(self._deliveries) if d.provider == provider and d.at <= horizon]

    def _postmark_search(self, query: Mapping[str, str]) -> Reply:
        try:
            count, offset = int(query["count"]), int(query["offset"])
        except (KeyError, ValueError):
            return _error("postmark", 422, "BadRequest", "count and offset are required")
        wanted = {name[len("metadata_"):]: value for name, value in query.items() if name.startswith("metadata_")}
        found = [d for d in self._searchable("postmark")
                 if all(d.payload.get("Metadata", {}).get(k) == v for k, v in wanted.items())]
        return Reply(200, {"TotalCount": len(found), "Messages": [
            {"MessageID": d.message_id, "Subject": d.subject, "Status": "Sent", "Recipients": list(d.recipients),
             "Metadata": d.payload.get("Metadata", {})} for d in found[offset:offset + count]]})

    def _sendgrid_search(self, query: Mapping[str, str]) -> Reply:
        match = _ACTIVITY_QUERY.match(query.get("query", ""))
        if match is None:
            return _error("sendgrid", 400, "BadRequest", "invalid query")
        limit = int(query.get("limit", "10"))
        found = [d for d in self._searchable("sendgrid")
                 if _custom_args(d.payload).get(match["name"]) == match["value"]]
        # Activity records carry the per-recipient id, which starts with the send's X-Message-Id.
        return Reply(200, {"messages": [
            {"msg_id": f"{d.message_id}.fake0.0", "subject": d.subject, "to_email": d.recipients[0],
             "status": "delivered", "opens_count": 0, "clicks_count": 0} for d in found[:limit]]})

    def _length_required(self) -> Reply:
        return Reply(411, {"message": "send a Content-Length"})


# -- the three dialects: what makes a message invalid, and what a delivery records --


def _postmark_problem(data: Mapping[str, Any]) -> str:
    if not data.get("From") or not (data.get("To") or data.get("Cc") or data.get("Bcc")):
        return "Invalid 'From' or 'To' address."
    if not (data.get("HtmlBody") or data.get("TextBody")):
        return "Provide either email TextBody or HtmlBody or both."
    return ""


def _sendgrid_problem(data: Mapping[str, Any]) -> str:
    people = data.get("personalizations")
    if not isinstance(people, list) or not people or not all(isinstance(p, dict) and p.get("to") for p in people):
        return "The personalizations field is required and must have at least one personalization with a to."
    if not isinstance(data.get("from"), dict) or not data["from"].get("email"):
        return "The from object must be provided for every email send."
    if not data.get("content"):
        return "Unless a valid template_id is provided, the content parameter is required."
    return ""


def _ses_problem(data: Mapping[str, Any]) -> str:
    simple = data.get("Content", {}).get("Simple") if isinstance(data.get("Content"), dict) else None
    if not data.get("FromEmailAddress") or not data.get("Destination"):
        return "Missing FromEmailAddress or Destination."
    if not isinstance(simple, dict) or not simple.get("Body") or not simple.get("Subject"):
        return "Content.Simple needs a Subject and a Body."
    return ""


def _header(pairs: Any, name: str) -> str | None:
    for pair in pairs if isinstance(pairs, list) else ():
        if isinstance(pair, dict) and str(pair.get("Name", "")).lower() == name.lower():
            return str(pair.get("Value"))
    return None


def _postmark_delivery(data: dict[str, Any], at: float) -> KeylessDelivery:
    recipients = tuple(a.strip() for f in ("To", "Cc", "Bcc") for a in str(data.get(f) or "").split(",") if a.strip())
    return KeylessDelivery("postmark", data.get("Metadata", {}).get("idemmail_key"),
                           _header(data.get("Headers"), "X-Idemmail-Key"), str(uuid.uuid4()), recipients,
                           str(data.get("Subject", "")), at, data)


def _custom_args(data: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(data.get("custom_args") or {})
    for person in data.get("personalizations") or ():
        merged.update(person.get("custom_args") or {})
    return merged


def _sendgrid_delivery(data: dict[str, Any], at: float) -> KeylessDelivery:
    recipients = tuple(str(a.get("email")) for p in data["personalizations"] for f in ("to", "cc", "bcc")
                       for a in p.get(f) or ())
    header_key = {str(k).lower(): v for k, v in (data.get("headers") or {}).items()}.get("x-idemmail-key")
    return KeylessDelivery("sendgrid", _custom_args(data).get("idemmail_key"), header_key,
                           secrets.token_urlsafe(16), recipients, str(data.get("subject", "")), at, data)


def _ses_delivery(data: dict[str, Any], at: float) -> KeylessDelivery:
    destination = data.get("Destination") or {}
    recipients = tuple(str(a) for f in ("ToAddresses", "CcAddresses", "BccAddresses") for a in destination.get(f) or ())
    simple = data["Content"]["Simple"]
    return KeylessDelivery("ses", _header(data.get("EmailTags"), "idemmail_key"),
                           _header(simple.get("Headers"), "X-Idemmail-Key"), f"{uuid.uuid4()}-000000", recipients,
                           str(simple.get("Subject", {}).get("Data", "")), at, data)


_PROBLEMS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "postmark": _postmark_problem, "sendgrid": _sendgrid_problem, "ses": _ses_problem,
}
_DELIVERIES: dict[str, Callable[[dict[str, Any], float], KeylessDelivery]] = {
    "postmark": _postmark_delivery, "sendgrid": _sendgrid_delivery, "ses": _ses_delivery,
}


def _redact(name: str, value: str) -> str:
    if name == "x-postmark-server-token":
        return "<redacted>"
    if name == "authorization" and value.lower().startswith(("bearer ", "basic ")):
        return value.split(" ", 1)[0] + " <redacted>"
    return value


def _iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
