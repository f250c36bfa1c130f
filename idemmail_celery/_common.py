"""Plumbing shared by the adapters (backoff, after-fork, the visibility timeout, log-safe text); no ledgers or tasks.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("idemmail_celery")

#: The library's own tasks, always redacted: a process may publish them by name without importing their modules.
LIBRARY_TASKS = ("idemmail_celery.send_email", "idemmail_celery.send_campaign")

def backoff(attempt: int, base: float, cap: float, *, jitter: bool = True) -> float:
    """Exponential backoff: ``min(cap, base * 2**attempt)``, with jitter between half and all of it (Celery's
    ``retry_backoff`` curve, but never immediate)."""
    ceiling = min(cap, base * (2 ** min(max(attempt, 0), 30)))
    return float(ceiling * random.uniform(0.5, 1.0)) if jitter else float(ceiling)


# -- fork safety: one registry, one os.register_at_fork --

_after_fork: list[Callable[[], None]] = []
_after_fork_lock = threading.Lock()


def after_fork(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` in every child right after ``fork()`` to reset sockets, threads and locks (a decorator
    too); one that raises is logged and the others still run."""
    with _after_fork_lock:
        _after_fork.append(callback)
    return callback


def _run_after_fork() -> None:
    global _after_fork_lock
    _after_fork_lock = threading.Lock()  # the parent may have held it while forking
    for callback in list(_after_fork):
        try:
            callback()
        except Exception:  # pragma: no cover - a broken reset must not stop the others
            log.exception("idemmail: after-fork reset %r failed", callback)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_run_after_fork)


def transport_visibility_timeout(app: Any) -> float | None:
    """The broker's visibility timeout in seconds, after which Redis and SQS hand out an unacknowledged message
    again; None for transports that do not (AMQP) or when it cannot be told."""
    try:
        url = str(app.conf.broker_url or "")
        scheme = url.split("://", 1)[0].split("+", 1)[0].lower() if "://" in url else url.lower()
        if scheme not in ("redis", "rediss", "sentinel", "sqs"):
            return None
        options = app.conf.broker_transport_options or {}
        value = options.get("visibility_timeout")
        if value is None:  # kombu's defaults: the Redis transport's, and SQS's own (a queue's may differ)
            return 1800.0 if scheme == "sqs" else 3600.0
        return float(value)
    except Exception:  # an unusual conf object: no cap rather than a crash on the task path
        return None


# -- log lines: what an outsider's text may not do to them --

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def quoted(text: str) -> str:
    """``text`` in double quotes, with quotes, backslashes and every unprintable character escaped."""
    return '"' + "".join(_ESCAPES.get(c) or (c if c.isprintable() else f"\\x{ord(c):02x}") for c in text) + '"'


def logsafe(value: object) -> str:
    """``value`` as a log line may show it: as it is when printable without quotes or backslashes, else
    :func:`quoted`, so that an outsider's newline cannot forge a line of its own. Use it for every outside value.
    """
    text = str(value)
    if text.isprintable() and '"' not in text and "\\" not in text:
        return text
    return quoted(text)
