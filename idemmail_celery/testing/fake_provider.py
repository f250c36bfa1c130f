"""A fake Resend-compatible email API: a real HTTP server on 127.0.0.1, for tests and demos.

It behaves like a provider that de-duplicates on ``Idempotency-Key``:

* ``POST /emails`` with ``Authorization: Bearer <api_key>`` accepts a message and
  answers ``200 {"id": ...}``; a wrong or missing key gets ``401``.
* The same key with the same body inside ``dedupe_window`` seconds replays the
  first ``200`` and is *not* a new delivery (it counts as a suppressed duplicate).
  The same key with another body gets ``409 invalid_idempotent_request``; the
  same key while its first request is still being processed gets
  ``409 concurrent_idempotent_requests``. ``dedupe=False`` plays a provider that
  ignores keys: every accepted request is a delivery. Bodies are compared byte
  for byte (by SHA-256), which is stricter than a real provider and so catches a
  client whose retries are not byte-identical.
* Faults are queued with :meth:`FakeProvider.fail_next` and consumed one per
  ``POST /emails``, in order (see :data:`FAULT_KINDS`).

Another process reads the counters with ``GET /_fake/stats`` and queues faults
with ``POST /_fake/faults`` (``{"kind": "slow", "times": 1}``); ``POST /_fake/reset``
forgets everything. These endpoints need no API key.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import sys
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

__all__ = ["DEFAULT_API_KEY", "FAULT_KINDS", "Attempt", "Delivery", "FakeProvider"]

DEFAULT_API_KEY = "re_fake_test_key"

FAULT_KINDS: Mapping[str, str] = {
    "drop_after_accept": "record the delivery, then close the connection without a response",
    "500_after_accept": "record the delivery, then answer 500",
    "503_before_accept": "answer 503 and record nothing",
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
class _Reply:
    status: int
    payload: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Stored:
    body_sha256: str
    message_id: str
    expires: float


def _error(status: int, name: str, message: str, headers: dict[str, str] | None = None) -> _Reply:
    return _Reply(status, {"statusCode": status, "name": name, "message": message}, headers or {})


class FakeProvider:
    """A Resend-compatible API on ``127.0.0.1``, started with :meth:`start` or ``with FakeProvider() as fake:``.

    ``api_key`` is the bearer token it expects (None accepts any non-empty one);
    ``dedupe_window`` is how long a key is remembered (seconds); ``slow_seconds``
    is how long a ``"slow"`` fault holds a request; ``port`` 0 picks a free one,
    kept across :meth:`stop`/:meth:`start` so :attr:`url` stays valid. At most
    ``max_records`` deliveries and attempts are kept as records; the counters stay exact.
    """

    def __init__(
        self,
        *,
        api_key: str | None = DEFAULT_API_KEY,
        dedupe: bool = True,
        dedupe_window: float = 24 * 3600.0,
        slow_seconds: float = 2.0,
        port: int = 0,
        max_records: int = 10_000,
    ) -> None:
        self.api_key = api_key
        self.dedupe = dedupe
        self.dedupe_window = dedupe_window
        self.slow_seconds = slow_seconds
        self._port = port
        self._lock = threading.Lock()
        self._faults: deque[str] = deque()
        self._deliveries: deque[Delivery] = deque(maxlen=max_records)
        self._attempts: deque[Attempt] = deque(maxlen=max_records)
        self._delivered: Counter[str | None] = Counter()
        self._attempted: Counter[str | None] = Counter()
        self._suppressed: Counter[str | None] = Counter()
        self._stored: dict[str, _Stored] = {}
        self._in_flight: dict[str, str] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()

    # -- lifecycle --

    def start(self) -> FakeProvider:
        """Listen and serve in a daemon thread; returns self. Starting a started fake does nothing."""
        if self._server is not None:
            return self
        self._stopping = threading.Event()
        server = _Server(("127.0.0.1", self._port), _Handler)
        server.fake = self
        self._port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"fake-provider:{self._port}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection (a request held by a "slow" fault is dropped, unrecorded)."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        # Keep-alive connections outlive serve_forever(); cut them so no handler thread keeps answering.
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        server.server_close()
        if thread is not None:
            thread.join(timeout=5.0)
        self._server = self._thread = None

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The TCP port (known once started)."""
        if not self._port:
            raise RuntimeError("the fake provider is not started")
        return self._port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``; the HTTP provider POSTs to ``/emails`` under it."""
        return f"http://127.0.0.1:{self.port}"

    # -- test API --

    def fail_next(self, kind: str, times: int = 1) -> None:
        """Apply fault ``kind`` (one of :data:`FAULT_KINDS`) to the next ``times`` sends, after those already queued."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(sorted(FAULT_KINDS))}")
        if times < 1:
            raise ValueError("times must be at least 1")
        with self._lock:
            self._faults.extend([kind] * times)

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
        with self._lock:
            return sum(self._delivered.values()) if key is None else self._delivered[key]

    def attempt_count(self, key: str | None = None) -> int:
        """Requests received in all, or with ``key``."""
        with self._lock:
            return sum(self._attempted.values()) if key is None else self._attempted[key]

    def duplicates_suppressed(self, key: str | None = None) -> int:
        """Requests answered by replaying an earlier delivery's response, in all or under ``key``."""
        with self._lock:
            return sum(self._suppressed.values()) if key is None else self._suppressed[key]

    def stats(self) -> dict[str, Any]:
        """What ``GET /_fake/stats`` answers: totals, and per key counts."""
        with self._lock:
            keys = {k for k in (*self._attempted, *self._delivered) if k is not None}
            return {
                "deliveries": sum(self._delivered.values()),
                "attempts": sum(self._attempted.values()),
                "suppressed": sum(self._suppressed.values()),
                "pending_faults": list(self._faults),
                "per_key": {
                    k: {"deliveries": self._delivered[k], "attempts": self._attempted[k],
                        "suppressed": self._suppressed[k]}
                    for k in sorted(keys)
                },
            }

    def reset(self) -> None:
        """Forget deliveries, attempts, remembered keys and queued faults."""
        with self._lock:
            self._faults.clear()
            self._deliveries.clear()
            self._attempts.clear()
            self._delivered.clear()
            self._attempted.clear()
            self._suppressed.clear()
            self._stored.clear()
            self._in_flight.clear()

    # -- the API, called by the handler threads --

    def _track(self, conn: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _send_email(self, headers: Mapping[str, str], body: bytes) -> _Reply | None:
        """Answer one ``POST /emails``; None means "close the connection without a response"."""
        key = headers.get("idempotency-key") or None
        sha = hashlib.sha256(body).hexdigest()
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        authorized = scheme.lower() == "bearer" and bool(token) and (self.api_key is None or token == self.api_key)
        seen = {k: (f"{scheme} <redacted>" if k == "authorization" else v) for k, v in headers.items()}

        def finish(reply: _Reply | None, outcome: str, fault: str | None) -> _Reply | None:
            attempt = Attempt(key, time.time(), reply.status if reply else None, outcome, fault, authorized, sha,
                              body, seen)
            with self._lock:
                self._attempts.append(attempt)
                self._attempted[key] += 1
            return reply

        with self._lock:
            fault = self._faults.popleft() if self._faults else None
        if fault in _BEFORE_ACCEPT:
            status, name, text = _BEFORE_ACCEPT[fault]
            return finish(_error(status, name, text, {"Retry-After": "1"} if status == 429 else None), fault, fault)
        if not authorized:
            reason = "missing_api_key" if not token else "invalid_api_key"
            return finish(_error(401, reason, "API key is invalid" if token else "Missing API key"),
                          "unauthorized", fault)
        problem = _validate(body)
        if problem:
            return finish(_error(422, "validation_error", problem), "invalid", fault)

        replay: _Stored | None = None
        conflict: tuple[_Reply, str] | None = None
        with self._lock:
            now = time.monotonic()
            for stale in [k for k, s in self._stored.items() if s.expires <= now]:
                del self._stored[stale]
            if self.dedupe and key is not None:
                replay = self._stored.get(key)
                pending = self._in_flight.get(key)
                if (replay and replay.body_sha256 != sha) or (pending is not None and pending != sha):
                    conflict = (_error(409, "invalid_idempotent_request",
                                       "this idempotency key was used with a different request body"),
                                "key_payload_mismatch")
                elif pending is not None:
                    conflict = (_error(409, "concurrent_idempotent_requests",
                                       "a request with this idempotency key is still being processed"), "in_flight")
                elif replay is None:
                    self._in_flight[key] = sha
        if conflict is not None:
            return finish(conflict[0], conflict[1], fault)

        if fault == "slow" and self._stopping.wait(self.slow_seconds):
            # Stopped mid-request: a provider that went down before accepting.
            with self._lock:
                if key is not None:
                    self._in_flight.pop(key, None)
            return finish(None, "stopped", fault)

        if replay is not None:
            with self._lock:
                self._suppressed[key] += 1
            message_id, outcome = replay.message_id, "replayed"
        else:
            message_id, outcome = str(uuid.uuid4()), "delivered"
            data = json.loads(body)
            delivery = Delivery(key, _recipients(data), str(data.get("subject", "")), sha, message_id, time.time())
            with self._lock:
                self._deliveries.append(delivery)
                self._delivered[key] += 1
                if self.dedupe and key is not None:
                    self._in_flight.pop(key, None)
                    self._stored[key] = _Stored(sha, message_id, time.monotonic() + self.dedupe_window)

        if fault == "drop_after_accept":
            return finish(None, f"{outcome}+dropped", fault)
        if fault == "500_after_accept":
            return finish(_error(500, "internal_server_error", "an unexpected error occurred"),
                          f"{outcome}+500", fault)
        reply_headers = {"Idempotent-Replayed": "true"} if replay is not None else {}
        return finish(_Reply(200, {"id": message_id}, reply_headers), outcome, fault)

    def _queue_faults(self, body: bytes) -> _Reply:
        try:
            data = json.loads(body or b"{}")
            if "slow_seconds" in data:
                self.slow_seconds = float(data["slow_seconds"])
            if "kind" in data:
                self.fail_next(str(data["kind"]), int(data.get("times", 1)))
        except (ValueError, TypeError, AttributeError) as exc:
            return _error(400, "bad_fault", str(exc))
        with self._lock:
            return _Reply(200, {"pending_faults": list(self._faults), "slow_seconds": self.slow_seconds})


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeProvider

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up is part of the game, not a server bug.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.server.fake._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.fake._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        if urlsplit(self.path).path == "/_fake/stats":
            self._reply(_Reply(200, self.server.fake.stats()))
        else:
            self._reply(_error(404, "not_found", f"no route {self.path}"))

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._reply(_error(411, "length_required", "send a Content-Length"))
            return
        body = self.rfile.read(int(length))
        fake = self.server.fake
        if path == "/_fake/faults":
            self._reply(fake._queue_faults(body))
        elif path == "/_fake/reset":
            fake.reset()
            self._reply(_Reply(200, {"reset": True}))
        elif path == "/emails" or path.endswith("/emails"):
            headers = {k.lower(): v for k, v in self.headers.items()}
            reply = fake._send_email(headers, body)
            if reply is None:
                self.close_connection = True
                return
            self._reply(reply)
        else:
            self._reply(_error(404, "not_found", f"no route {self.path}"))

    def _reply(self, reply: _Reply) -> None:
        data = json.dumps(reply.payload).encode("utf-8")
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Request-Id", str(uuid.uuid4()))
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            # The client gave up (a read timeout) before the answer was ready.
            self.close_connection = True
