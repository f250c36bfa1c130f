"""The HTTP plumbing of the fakes (:mod:`.fake_provider`, :mod:`.fake_keyless`, :mod:`.fake_api`).

A subclass of :class:`FakeHTTPServer` answers each request in :meth:`~FakeHTTPServer._handle`, with a
:class:`Reply` or with None to close the connection unanswered (the "dropped after accept" faults).
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, ClassVar, TypeVar

_Fake = TypeVar("_Fake", bound="FakeHTTPServer")

#: The faults around accepting a send, which every fake offers in these words (in its own ``FAULT_KINDS``).
ACCEPT_FAULTS: Mapping[str, str] = {
    "drop_after_accept": "record the delivery, then close the connection without a response",
    "500_after_accept": "record the delivery, then answer 500",
    "503_before_accept": "answer 503 and record nothing",
}


@dataclass(frozen=True)
class Reply:
    """One answer: ``payload`` goes out as JSON; None sends an empty body, without a Content-Type."""

    status: int
    payload: Any
    headers: dict[str, str] = field(default_factory=dict)


class FakeHTTPServer:
    """A fake API on ``127.0.0.1``, started with :meth:`start` or ``with``; ``port`` 0 picks a free one.

    The port is kept across :meth:`stop`/:meth:`start`, so a URL built from it stays valid.
    ``host`` is the address to listen on (``0.0.0.0`` for a container's other services).
    """

    #: The serving thread's name, before ``:port``.
    thread_name: ClassVar[str] = "fake-http"
    #: The faults :meth:`fail_next` accepts, and what each does to one send.
    fault_kinds: ClassVar[Mapping[str, str]] = {}
    #: Whether a dropped request has its socket shut down at once, rather than when the handler returns.
    cut_dropped_connections: ClassVar[bool] = False

    def __init__(self, *, port: int = 0, host: str = "127.0.0.1") -> None:
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._faults: deque[str] = deque()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        #: Set when :meth:`stop` begins, so a handler holding a request back can let go.
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()

    @property
    def port(self) -> int:
        """The TCP port (known once started)."""
        if not self._port:
            raise RuntimeError(f"the {self.thread_name} server is not started")
        return self._port

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:54321``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self: _Fake) -> _Fake:
        """Listen and serve in a daemon thread; returns self. Starting a started fake does nothing."""
        if self._server is not None:
            return self
        self._stopping = threading.Event()
        server = _Server((self._host, self._port), _Handler)
        server.fake = self
        self._port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"{self.thread_name}:{self._port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection."""
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

    def __enter__(self: _Fake) -> _Fake:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def fail_next(self, kind: str, times: int = 1) -> None:
        """Apply fault ``kind`` (one of :attr:`fault_kinds`) to the next ``times`` sends, after those queued."""
        if kind not in self.fault_kinds:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(sorted(self.fault_kinds))}")
        with self._lock:
            self._faults.extend([kind] * times)

    def _next_fault(self) -> str | None:
        """The fault for the send being answered, taken off the queue; None when none is queued."""
        with self._lock:
            return self._faults.popleft() if self._faults else None

    def _handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Reply | None:
        """Answer one request (``headers`` with lower-case names); None closes the connection unanswered."""
        raise NotImplementedError

    def _length_required(self) -> Reply:
        """The answer to a POST without a usable Content-Length (the connection is closed after it)."""
        return Reply(411, {"error": "send a Content-Length"})

    def _reply_headers(self) -> dict[str, str]:
        """Headers sent with every answer, before the answer's own."""
        return {}

    def _count(self, counter: Counter[str | None], key: str | None) -> int:
        """A counter's total, or its count for ``key``."""
        with self._lock:
            return sum(counter.values()) if key is None else counter[key]

    def _track(self, conn: socket.socket, open_: bool) -> None:
        with self._lock:
            (self._connections.add if open_ else self._connections.discard)(conn)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeHTTPServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out and hung up is part of the game, not a server bug.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Replies are small writes: without TCP_NODELAY each can wait ~40 ms on the client's delayed ACK.
    disable_nagle_algorithm = True
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
        self._answer(b"")

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._reply(self.server.fake._length_required())
            return
        self._answer(self.rfile.read(int(length)))

    def _answer(self, body: bytes) -> None:
        fake = self.server.fake
        headers = {k.lower(): v for k, v in self.headers.items()}
        reply = fake._handle(self.command, self.path, headers, body)
        if reply is None:
            self.close_connection = True
            if fake.cut_dropped_connections:
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_RDWR)
            return
        self._reply(reply)

    def _reply(self, reply: Reply) -> None:
        data = b"" if reply.payload is None else json.dumps(reply.payload).encode("utf-8")
        try:
            self.send_response(reply.status)
            if data:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for headers in (self.server.fake._reply_headers(), reply.headers):
                for name, value in headers.items():
                    self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:
            # The client gave up (a read timeout) before the answer was ready.
            self.close_connection = True
