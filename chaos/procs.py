"""Worker subprocesses that are always reaped: start, SIGKILL (a pool child or the whole worker), restart, stop.

Each worker runs in a session (and process group) of its own, so one ``killpg`` reaches the
main process and every pool child, and a Ctrl-C in the terminal never reaches it directly.
Every :class:`WorkerProcess` registers itself in :data:`ALIVE`; :func:`reap_all` (installed as
an ``atexit`` hook and called from the scripts' ``finally``) kills whatever is left.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALIVE: set[WorkerProcess] = set()
_alive_lock = threading.Lock()


def cpu_ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return int(fields[11]) + int(fields[12])


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out.extend(int(c) for c in (task / "children").read_text().split())
    except OSError:
        return []
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` alone (0 if it is gone)."""
    return cpu_ticks(pid) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live children."""
    return cpu_seconds(pid) + sum(cpu_seconds(c) for c in children_of(pid))


class WorkerProcess:
    """One ``celery worker`` subprocess in its own process group; ``python`` and ``cwd`` (this interpreter, the
    repository by default) run it from another install, as ``make upgrade-check`` runs the previous release's."""

    def __init__(self, name: str, app: str, args: list[str], env: dict[str, str], log_dir: Path,
                 python: str | Path | None = None, cwd: str | Path | None = None) -> None:
        self.name, self.app, self.args, self.env, self.log_dir = name, app, args, env, log_dir
        self.python, self.cwd = str(python or sys.executable), Path(cwd or ROOT)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}-{self.starts}.log"

    def start(self, wait_ready: float = 90.0) -> WorkerProcess:
        """Start (or restart) the worker and wait for its ``ready.`` line."""
        self.starts += 1
        cmd = [self.python, "-m", "celery", "-A", self.app, "worker", "--loglevel=INFO",
               "--without-gossip", "--without-mingle", "--without-heartbeat",
               "-n", f"{self.name}.{self.starts}@%h", *self.args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        with _alive_lock:
            ALIVE.add(self)
        if wait_ready:
            deadline = time.monotonic() + wait_ready
            while b"ready." not in self.log():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.name} exited at start-up; see {self.log_path}")
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"worker {self.name} not ready within {wait_ready}s; see {self.log_path}")
                time.sleep(0.05)
        return self

    def log(self) -> bytes:
        try:
            return self.log_path.read_bytes()
        except OSError:
            return b""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def alive(self) -> bool:
        return self.pid is not None

    def pool_children(self) -> list[int]:
        """PIDs of the prefork pool children right now."""
        pid = self.pid
        return children_of(pid) if pid else []

    def cpu_seconds(self) -> float:
        """CPU seconds of the worker's main process and its live pool children."""
        pid = self.pid
        return tree_cpu_seconds(pid) if pid else 0.0

    def main_cpu_seconds(self) -> float:
        """CPU seconds of the worker's main process alone (the consumer: fetch, dispatch, acknowledgement)."""
        pid = self.pid
        return cpu_seconds(pid) if pid else 0.0

    def kill(self) -> None:
        """SIGKILL the whole worker (main process and pool children) and reap it."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        with _alive_lock:
            ALIVE.discard(self)

    def stop(self, timeout: float = 20.0) -> None:
        """Warm shutdown (SIGTERM to the group); SIGKILL if it takes longer than ``timeout``."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
        # Pool children outlive a main process that died first: the group goes in any case.
        self.kill()


def stop_all(workers: list[WorkerProcess], timeout: float = 20.0) -> None:
    """Warm-stop several workers at once (SIGTERM to every group first, then wait)."""
    for w in workers:
        if w.proc is not None and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, signal.SIGTERM)
    for w in workers:
        w.stop(timeout=timeout)


def reap_all() -> None:
    """Kill every worker still registered (used on exit, error and Ctrl-C)."""
    with _alive_lock:
        workers = list(ALIVE)
    for w in workers:
        w.kill()


atexit.register(reap_all)


def install_signal_handlers() -> None:
    """Turn SIGINT/SIGTERM/SIGHUP into KeyboardInterrupt so ``finally`` blocks reap the workers."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition`` until truthy; False when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())
