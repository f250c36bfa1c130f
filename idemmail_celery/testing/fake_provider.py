"""A fake Resend-compatible email API that de-duplicates on ``Idempotency-Key``, for tests and demos.

Its routes, its de-duplication and the ``/_fake/*`` endpoints another process uses: docs/testing.md.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ._server import ACCEPT_FAULTS, FakeHTTPServer, Reply

__all__ = ["DEFAULT_API_KEY", "FAULT_KINDS", "Attempt", "Delivery", "FakeProvider"]

DEFAULT_API_KEY = "re_fake_test_key"

FAULT_KINDS: Mapping[str, str] = {
    **ACCEPT_FAULTS,
    "slow": "hold the key in flight for slow_seconds, then accept normally",
    "429": "answer 429 with Retry-After: 1, record nothing",
    "409_processing": "answer 409 concurrent_idempotent_requests, record nothing",
    "401": "answer 401 as if the API key were wrong, record nothing",
    "422": "answer 422 validation_error, record nothing",
}
"""Every fault :meth:`FakeProvider.fail_next` accepts, and what it does to one request."""

_BEFORE_ACCEPT: dict[str, tuple[int, str, str]] = {
    "503_before_accept": (503, "service_unavailable", "the service is temporarily unavailable"),
    "429": (429, "rate_limit_exceeded", "too many requests"),
    "409_processing": (409, "concurrent_idempotent_requests", "a request with this idempotency key is in progress"),
    "401": (401, "invalid_api_key", "API key is invalid"),
    "422": (422, "validation_error", "the message was rejected"),
}


@dataclass(frozen=True)
class Delivery:
    """One message the fake accepted: what a real provider would have sent."""

    key: str | None
    recipients: tuple[str, ...]
    subject: str
    body_sha256: str
    message_id: str
    at: float


@dataclass(frozen=True)
class Attempt:
    """One ``POST /emails`` as the server saw it. ``status`` is None when the fault dropped the connection."""

    key: str | None
    at: float
    status: int | None
    outcome: str
    fault: str | None
    authorized: bool
    body_sha256: str
    body: bytes = field(repr=False)
    headers: dict[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class _Stored:
    body_sha256: str
    message_id: str
    expires: float


@dataclass(frozen=True)
class _EmailRequest:
    """One ``POST /emails`` as the fake reads it: ``seen`` is its headers as recorded (the API key redacted)."""

    key: str | None
    sha: str
    body: bytes
    token: str
    authorized: bool
    seen: dict[str, str]

    @classmethod
    def read(cls, headers: Mapping[str, str], body: bytes, api_key: str | None) -> _EmailRequest:
        """``api_key``: the bearer token expected (None: any non-empty one)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        authorized = scheme.lower() == "bearer" and bool(token) and (api_key is None or token == api_key)
        seen = {k: (f"{scheme} <redacted>" if k == "authorization" else v) for k, v in headers.items()}
        return cls(headers.get("idempotency-key") or None, hashlib.sha256(body).hexdigest(), body, token,
                   authorized, seen)


def _error(status: int, name: str, message: str, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, {"statusCode": status, "name": name, "message": message}, headers or {})


class FakeProvider(FakeHTTPServer):
    """A Resend-compatible API on ``127.0.0.1``; ``with FakeProvider() as fake:`` (options: docs/testing.md).

    ``dedupe_window``, ``slow_seconds`` (a ``"slow"`` fault's hold) and ``latency`` (every send's hold, as a
    real provider's processing time; added to ``"slow"``) are in seconds.
    """

    thread_name = "fake-provider"
    fault_kinds = FAULT_KINDS

    def __init__(self, *, api_key: str | None = DEFAULT_API_KEY, dedupe: bool = True,
                 dedupe_window: float = 24 * 3600.0, slow_seconds: float = 2.0, port: int = 0,
                 max_records: int = 10_000, host: str = "127.0.0.1", latency: float = 0.0) -> None:
        if latency < 0:
            raise ValueError("latency must not be negative")
        self.api_key = api_key
        self.dedupe = dedupe
        self.dedupe_window = dedupe_window
        self.slow_seconds = slow_seconds
        self.latency = latency
        super().__init__(port=port, host=host)
        self._deliveries: deque[Delivery] = deque(maxlen=max_records)
        self._attempts: deque[Attempt] = deque(maxlen=max_records)
        self._delivered: Counter[str | None] = Counter()
        self._attempted: Counter[str | None] = Counter()
        self._suppressed: Counter[str | None] = Counter()
        self._stored: dict[str, _Stored] = {}
        self._in_flight: dict[str, str] = {}

    def fail_next(self, kind: str, times: int = 1) -> None:
        """Apply fault ``kind`` (one of :data:`FAULT_KINDS`) to the next ``times`` sends, after those already queued."""
        # Stricter than the base about times; an unknown kind is still the first thing reported.
        if kind in FAULT_KINDS and times < 1:
            raise ValueError("times must be at least 1")
        super().fail_next(kind, times)

    def deliveries(self) -> list[Delivery]:
        """Every accepted message, oldest first."""
        with self._lock:
            return list(self._deliveries)

    def attempts(self) -> list[Attempt]:
        """Every ``POST /emails`` received, oldest first, whatever its outcome."""
        with self._lock:
            return list(self._attempts)

    def delivery_count(self, key: str | None = None) -> int:
        """Deliveries in all, or under ``key``."""
        return self._count(self._delivered, key)

    def attempt_count(self, key: str | None = None) -> int:
        """Requests received in all, or with ``key``."""
        return self._count(self._attempted, key)

    def duplicates_suppressed(self, key: str | None = None) -> int:
        """Requests answered by replaying an earlier delivery's response, in all or under ``key``."""
        return self._count(self._suppressed, key)

    def stats(self) -> dict[str, Any]:
        """What ``GET /_fake/stats`` answers: totals, and per key counts."""
        with self._lock:
            counters = {"deliveries": self._delivered, "attempts": self._attempted, "suppressed": self._suppressed}
            keys = sorted({k for k in (*self._attempted, *self._delivered) if k is not None})
            return {**{name: sum(c.values()) for name, c in counters.items()}, "pending_faults": list(self._faults),
                    "per_key": {k: {name: c[k] for name, c in counters.items()} for k in keys}}

    def reset(self) -> None:
        """Forget deliveries, attempts, remembered keys and queued faults."""
        with self._lock:
            for store in (self._faults, self._deliveries, self._attempts, self._delivered, self._attempted,
                          self._suppressed, self._stored, self._in_flight):
                store.clear()

    def _handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Reply | None:
        path = urlsplit(target).path
        if method == "GET" and path == "/_fake/stats":
            return Reply(200, self.stats())
        if method == "GET" and path == "/_fake/deliveries":
            return Reply(200, [{"key": d.key, "to": list(d.recipients), "subject": d.subject,
                                "message_id": d.message_id, "at": d.at} for d in self.deliveries()])
        if method == "POST":
            if path == "/_fake/faults":
                return self._queue_faults(body)
            if path == "/_fake/reset":
                self.reset()
                return Reply(200, {"reset": True})
            if path == "/emails" or path.endswith("/emails"):
                return self._send_email(headers, body)
        return _error(404, "not_found", f"no route {target}")

    def _length_required(self) -> Reply:
        return _error(411, "length_required", "send a Content-Length")

    def _reply_headers(self) -> dict[str, str]:
        return {"X-Request-Id": str(uuid.uuid4())}

    def _forget_expired(self, now: float) -> None:
        """Drop remembered keys whose window has passed, oldest first (in insertion order): O(expired), not O(keys)."""
        while self._stored:
            oldest = next(iter(self._stored))
            if self._stored[oldest].expires > now:
                return
            del self._stored[oldest]

    def _send_email(self, headers: Mapping[str, str], body: bytes) -> Reply | None:
        """Answer one ``POST /emails``; None means "close the connection without a response"."""
        request = _EmailRequest.read(headers, body, self.api_key)
        fault = self._next_fault()
        reply, outcome = self._answer(request, fault)
        attempt = Attempt(request.key, time.time(), reply.status if reply else None, outcome, fault,
                          request.authorized, request.sha, body, request.seen)
        with self._lock:
            self._attempts.append(attempt)
            self._attempted[request.key] += 1
        return reply

    def _answer(self, request: _EmailRequest, fault: str | None) -> tuple[Reply | None, str]:
        refused = self._refusal(request, fault)
        if refused is not None:
            return refused
        replay, conflict = self._take_key(request)
        if conflict is not None:
            return conflict
        hold = self.latency + (self.slow_seconds if fault == "slow" else 0.0)
        if hold > 0 and self._stopping.wait(hold):
            # Stopped mid-request: a provider that went down before accepting.
            with self._lock:
                if request.key is not None:
                    self._in_flight.pop(request.key, None)
            return None, "stopped"
        message_id, outcome = self._accept(request, replay)
        if fault == "drop_after_accept":
            return None, f"{outcome}+dropped"
        if fault == "500_after_accept":
            return _error(500, "internal_server_error", "an unexpected error occurred"), f"{outcome}+500"
        reply_headers = {"Idempotent-Replayed": "true"} if replay is not None else {}
        return Reply(200, {"id": message_id}, reply_headers), outcome

    def _refusal(self, request: _EmailRequest, fault: str | None) -> tuple[Reply, str] | None:
        """A fault that refuses before anything is accepted, a wrong API key, or a body Resend would refuse."""
        if fault in _BEFORE_ACCEPT:
            status, name, text = _BEFORE_ACCEPT[fault]
            return _error(status, name, text, {"Retry-After": "1"} if status == 429 else None), fault
        if not request.authorized:
            if request.token:
                return _error(401, "invalid_api_key", "API key is invalid"), "unauthorized"
            return _error(401, "missing_api_key", "Missing API key"), "unauthorized"
        problem = _validate(request.body)
        if problem:
            return _error(422, "validation_error", problem), "invalid"
        return None

    def _take_key(self, request: _EmailRequest) -> tuple[_Stored | None, tuple[Reply, str] | None]:
        """The stored response this request replays (if any), or the 409 its key earns; marks a new key in flight."""
        key, sha = request.key, request.sha
        with self._lock:
            now = time.monotonic()
            self._forget_expired(now)
            if not self.dedupe or key is None:
                return None, None
            replay = self._stored.get(key)
            if replay is not None and replay.expires <= now:  # behind an entry stored for longer
                del self._stored[key]
                replay = None
            pending = self._in_flight.get(key)
            if (replay and replay.body_sha256 != sha) or (pending is not None and pending != sha):
                return replay, (_error(409, "invalid_idempotent_request",
                                       "this idempotency key was used with a different request body"),
                                "key_payload_mismatch")
            if pending is not None:
                return replay, (_error(409, "concurrent_idempotent_requests",
                                       "a request with this idempotency key is still being processed"), "in_flight")
            if replay is None:
                self._in_flight[key] = sha
            return replay, None

    def _accept(self, request: _EmailRequest, replay: _Stored | None) -> tuple[str, str]:
        """Count a replay, or record a new delivery (and remember its key): its message id and the outcome."""
        key = request.key
        if replay is not None:
            with self._lock:
                self._suppressed[key] += 1
            return replay.message_id, "replayed"
        message_id = str(uuid.uuid4())
        data = json.loads(request.body)
        delivery = Delivery(key, _recipients(data), str(data.get("subject", "")), request.sha, message_id, time.time())
        with self._lock:
            self._deliveries.append(delivery)
            self._delivered[key] += 1
            if self.dedupe and key is not None:
                self._in_flight.pop(key, None)
                self._stored[key] = _Stored(request.sha, message_id, time.monotonic() + self.dedupe_window)
        return message_id, "delivered"

    def _queue_faults(self, body: bytes) -> Reply:
        try:
            data = json.loads(body or b"{}")
            if "slow_seconds" in data:
                self.slow_seconds = float(data["slow_seconds"])
            if "latency" in data:
                latency = float(data["latency"])
                if latency < 0:
                    raise ValueError("latency must not be negative")
                self.latency = latency
            if "kind" in data:
                self.fail_next(str(data["kind"]), int(data.get("times", 1)))
        except (ValueError, TypeError, AttributeError) as exc:
            return _error(400, "bad_fault", str(exc))
        with self._lock:
            return Reply(200, {"pending_faults": list(self._faults), "slow_seconds": self.slow_seconds,
                               "latency": self.latency})


def _validate(body: bytes) -> str:
    """Why Resend would refuse this body with 422, or ""."""
    try:
        data = json.loads(body)
    except ValueError:
        return "the body is not JSON"
    if not isinstance(data, dict):
        return "the body is not a JSON object"
    for name in ("from", "to", "subject"):
        if not data.get(name):
            return f"missing `{name}` field"
    if not (data.get("html") or data.get("text")):
        return "missing `html` or `text` field"
    return ""


def _recipients(data: Mapping[str, Any]) -> tuple[str, ...]:
    out: list[str] = []
    for name in ("to", "cc", "bcc"):
        value = data.get(name) or []
        out.extend([value] if isinstance(value, str) else [str(v) for v in value])
    return tuple(out)
