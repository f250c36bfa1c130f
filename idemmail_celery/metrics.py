"""Prometheus metrics for idempotent sends (optional: ``pip install idemmail-celery[metrics]``).

Off by default, and then free: nothing imports ``prometheus_client``. The settings that turn them on, the
metrics, and ``PROMETHEUS_MULTIPROC_DIR`` for a prefork worker: docs/operations.md, "Metrics". Metrics
never change an outcome: the first failing Prometheus call turns them off in that process (:func:`broken`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from celery.signals import worker_process_shutdown

from ._common import logsafe

log = logging.getLogger("idemmail_celery")

LEDGER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RECORDS_TTL = 30.0
#: States whose records never expire: what is in flight, waiting, or waiting for a person.
RECORD_STATES = ("claimed", "released", "review")

#: The live :class:`Metrics` while metrics are on, else None (what the hot path looks at).
active: Metrics | None = None
#: Set when a Prometheus call failed in this process: metrics stay off here from then on.
_broken = False
_lock = threading.Lock()
_servers: dict[tuple[str, int], Any] = {}


class Metrics:
    """The collectors, created once per process by :func:`enable`."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        registry = REGISTRY if registry is None else registry
        self.outcomes = Counter("idemmail_outcomes_total", "Runs of idempotent tasks by outcome",
                                ["task", "outcome"], registry=registry)
        self.inflight = Counter("idemmail_inflight_collisions_total",
                                "Runs that found a live claim of another worker and were rescheduled",
                                ["task"], registry=registry)
        self.unrecorded_runs = Counter("idemmail_unrecorded_total", "Outcomes the ledger does not hold: sent after the "
                                       "lease was lost (maybe twice) or while the ledger was down, fail_open runs, "
                                       "failed/review verdicts it refused", ["task", "outcome", "reason"],
                                       registry=registry)
        self.failed_runs = Counter("idemmail_failed_total", "Runs that ended failed, by reason (retry_deadline: "
                                   "the provider refused every attempt until the intent's retry deadline)",
                                   ["task", "reason"], registry=registry)
        self.reclaims = Counter("idemmail_reclaims_total", "Claims taken over after their holder's lease expired",
                                ["task"], registry=registry)
        self.ledger_seconds = Histogram("idemmail_ledger_operation_seconds", "Ledger operation latency",
                                        ["op", "backend"], buckets=LEDGER_BUCKETS, registry=registry)
        self.ledger_errors = Counter("idemmail_ledger_errors_total", "Ledger operations that raised",
                                     ["op", "backend", "error"], registry=registry)
        self._children: dict[tuple[str, str], Any] = {}
        self._observers: dict[tuple[str, str], Any] = {}

    # Every count below never raises: a failing Prometheus call turns metrics off (see broken).

    def outcome(self, task: str, status: str) -> None:
        """Count one report of :mod:`idemmail_celery.outcomes`."""
        try:
            child = self._children.get((task, status))
            if child is None:
                child = self._children[(task, status)] = self.outcomes.labels(task, status)
            child.inc()
            if status == "in_flight":
                self.inflight.labels(task).inc()
        except Exception as exc:
            broken(exc)

    def unrecorded(self, task: str, status: str, reason: str) -> None:
        """Count an outcome the ledger does not hold (``recorded=false`` in the report)."""
        _count(self.unrecorded_runs, task, status, reason)

    def failed(self, task: str, reason: str) -> None:
        """Count an outcome ``failed`` by its reason word."""
        _count(self.failed_runs, task, reason)

    def reclaimed(self, task: str) -> None:
        """Count a dead holder's claim taken over (not an outcome: the run goes on to one)."""
        _count(self.reclaims, task)

    def ledger_call(self, op: str, backend: str, seconds: float, error: str | None) -> None:
        """Time one ledger operation (and count it if it raised ``error``), for ``MeteredLedger``."""
        try:
            observe = self._observers.get((op, backend))
            if observe is None:
                observe = self._observers[(op, backend)] = self.ledger_seconds.labels(op, backend).observe
            observe(seconds)
            if error is not None:
                self.ledger_errors.labels(op, backend, error).inc()
        except Exception as exc:
            broken(exc)


def _count(counter: Any, *labels: str) -> None:
    try:
        counter.labels(*labels).inc()
    except Exception as exc:
        broken(exc)


def available() -> bool:
    """Is ``prometheus_client`` installed?"""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def enable() -> Metrics:
    """Turn metrics on in this process (idempotent): every ledger opened through :func:`idemmail_celery.ledger.shared`
    is timed from now on. :class:`~idemmail_celery.errors.ConfigurationError` without ``prometheus_client``."""
    global active
    with _lock:
        if active is None:
            if not available():
                from .errors import ConfigurationError

                raise ConfigurationError("idemmail metrics need prometheus-client: "
                                         "pip install idemmail-celery[metrics]")
            active = Metrics()
        return active


def broken(exc: BaseException) -> None:
    """A Prometheus call failed: turn metrics off in this process, say so once (ERROR), go on sending."""
    global active, _broken
    with _lock:
        first, _broken, active = not _broken, True, None
    if first:
        log.error("idemmail metrics: prometheus_client failed (%s: %s); metrics are OFF in process %d, "
                  "sends go on. Check PROMETHEUS_MULTIPROC_DIR (%s)", type(exc).__name__, logsafe(exc), os.getpid(),
                  multiprocess_dir() or "unset")


def check_multiprocess_dir(path: str) -> str | None:
    """Why ``path`` cannot hold the multiprocess files (missing, not a directory, not writable), or None."""
    if not os.path.isdir(path):
        return f"PROMETHEUS_MULTIPROC_DIR={path} does not exist or is not a directory"
    try:  # a file, not os.access: that says yes to root on a read-only mount
        fd, probe = tempfile.mkstemp(prefix=".idemmail-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"PROMETHEUS_MULTIPROC_DIR={path} is not writable ({exc.strerror or exc})"
    return None


class RecordsCollector:
    """``idemmail_ledger_records{state}`` and ``idemmail_ledger_up`` from a ledger, cached for ``ttl`` s."""

    def __init__(self, ledger: Callable[[], Any], ttl: float = RECORDS_TTL) -> None:
        self._ledger, self.ttl = ledger, ttl
        self._cached: tuple[float, dict[str, int] | None] = (0.0, None)
        self._lock = threading.Lock()

    def counts(self) -> dict[str, int] | None:
        """Records per non-expiring state, or None if the ledger cannot be read."""
        with self._lock:
            at, counts = self._cached
            if time.monotonic() - at < self.ttl and at:
                return counts
            try:
                stats = self._ledger().stats()  # one pipeline (Redis) or one GROUP BY (SQL)
                counts = {s: int(stats.get(s, 0)) for s in RECORD_STATES}
            except Exception as exc:
                log.warning("idemmail metrics: cannot count ledger records: %s", logsafe(exc))
                counts = None
            self._cached = (time.monotonic(), counts)
            return counts

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        counts = self.counts()
        up = GaugeMetricFamily("idemmail_ledger_up", "1 if the last count of ledger records succeeded")
        up.add_metric([], 0.0 if counts is None else 1.0)
        yield up
        records = GaugeMetricFamily("idemmail_ledger_records", "Ledger records in non-expiring states",
                                    labels=["state"])
        for state, n in (counts or {}).items():
            records.add_metric([state], float(n))
        yield records


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` if set (counters then live in files, one per process)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def serve(port: int, addr: str = "0.0.0.0", ledger: Callable[[], Any] | None = None) -> Any:
    """Serve ``/metrics`` on ``addr:port`` from this process, in a daemon thread (idempotent); with ``ledger`` (a
    function returning the app's ledger), with the record gauges too."""
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

    with _lock:
        if (addr, port) in _servers:
            return _servers[(addr, port)]
        if multiprocess_dir():
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        else:
            registry = REGISTRY
        if ledger is not None:
            registry.register(RecordsCollector(ledger))
        _servers[(addr, port)] = start_http_server(port, addr=addr, registry=registry)
        log.info("idemmail metrics on http://%s:%d/metrics%s", addr, port,
                 " (multiprocess)" if multiprocess_dir() else "")
        return _servers[(addr, port)]


def prepare_worker(*, port: int, pool: str) -> bool:
    """On ``worker_init`` (main process, before the pool starts): turn metrics on; False if they stay off.
    Never raises (Celery would swallow it, and half-enabled metrics could fail tasks)."""
    path = multiprocess_dir()
    if path:
        problem = check_multiprocess_dir(path)
        if problem:
            log.error("idemmail metrics: %s; metrics are OFF for this worker (sends go on). Create the "
                      "directory, empty, writable by the worker, before starting it", problem)
            return False
        stale = [n for n in os.listdir(path) if n.endswith(".db")]
        if stale:
            log.warning("idemmail metrics: PROMETHEUS_MULTIPROC_DIR=%s already holds %d .db files: their counts "
                        "are added to this worker's. Empty it before each worker start", path, len(stale))
    try:
        enable()
    except Exception as exc:
        log.error("idemmail metrics: cannot enable them (%s); metrics are OFF for this worker", logsafe(exc))
        return False
    if "prefork" in pool and not path:
        log.warning("idemmail metrics: a prefork worker counts in its pool processes; set "
                    "PROMETHEUS_MULTIPROC_DIR before starting it, or %s stays empty",
                    "/metrics" if port else "what this process exposes")
    return True


def _on_process_shutdown(pid: int | None = None, **_: Any) -> None:
    path = multiprocess_dir()
    if active is not None and path:
        from prometheus_client import multiprocess

        try:  # removes the process's live-gauge files only; its counters stay (and count)
            multiprocess.mark_process_dead(pid or os.getpid(), path)  # type: ignore[no-untyped-call]
        except Exception as exc:
            log.warning("idemmail metrics: mark_process_dead failed: %s", logsafe(exc))


worker_process_shutdown.connect(_on_process_shutdown, weak=False)
