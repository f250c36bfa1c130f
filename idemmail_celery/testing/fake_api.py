"""A fake JSON API that does *not* de-duplicate: a stand-in for a CRM, Slack or any webhook target (docs/testing.md).

A second request is a second side effect, so a test counts side effects with :meth:`FakeAPI.requests`.
A ``slow`` fault records the request after ``slow_seconds``: a client with a shorter timeout sees a
timeout although the effect happened.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from ._server import ACCEPT_FAULTS, FakeHTTPServer, Reply

__all__ = ["FakeAPI", "Request"]


@dataclass(frozen=True)
class Request:
    """One recorded ``POST``: its path, JSON body (None if not JSON), idempotency key header and time."""

    path: str
    body: Any
    idempotency_key: str | None
    at: float


class FakeAPI(FakeHTTPServer):
    """A JSON API on ``127.0.0.1`` recording every POST; ``with FakeAPI() as api: ... api.requests("/deals/7")``."""

    thread_name = "fake-api"
    fault_kinds: ClassVar[Mapping[str, str]] = {
        **ACCEPT_FAULTS,
        "slow": "hold the request for slow_seconds, then record it and answer 200",
    }

    def __init__(self, *, slow_seconds: float = 2.0, port: int = 0, host: str = "127.0.0.1") -> None:
        super().__init__(port=port, host=host)
        self.slow_seconds = slow_seconds
        self._requests: list[Request] = []

    def requests(self, path: str | None = None) -> list[Request]:
        """The recorded POSTs, oldest first, all or to ``path``."""
        with self._lock:
            return [r for r in self._requests if path is None or r.path == path]

    def _handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Reply | None:
        path = urlsplit(target).path
        if method == "GET" and path == "/_fake/requests":
            return Reply(200, [asdict(r) for r in self.requests()])
        if method != "POST":
            return Reply(404, {"error": f"no route {method} {target}"})
        fault = self._next_fault()
        if fault == "503_before_accept":
            return Reply(503, {"error": "service unavailable"})
        if fault == "slow" and self._stopping.wait(self.slow_seconds):
            return None
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        with self._lock:
            self._requests.append(Request(path, data, headers.get("idempotency-key"), time.time()))
            number = len(self._requests)
        if fault == "drop_after_accept":
            return None
        if fault == "500_after_accept":
            return Reply(500, {"error": "internal error"})
        return Reply(200, {"ok": True, "id": number})
