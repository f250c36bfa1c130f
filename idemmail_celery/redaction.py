"""Keep a task's arguments (addresses, subjects, bodies) out of what Celery shows of a message.

Celery copies a message's ``argsrepr``/``kwargsrepr`` headers into its task events
(Flower) and worker logs, and builds them from the real arguments unless the sender
gave its own. ``IdempotentTask.apply_async`` gives its own, but a message can be
published by other paths: ``app.send_task(name, ...)``, the outbox relay for a task
it does not know, canvas primitives, a retry. A ``before_task_publish`` handler
therefore redacts every message, whatever the path, of

* a task registered here as redacting: every ``IdempotentTask`` whose
  ``redact_args`` setting is on (the default), and ``send_campaign``;
* a task this process does not know that carries an intent key header
  (``idempotency_key``): it was derived by an idempotent task somewhere.

The redacted headers read ``<redacted>`` and ``<redacted: idempotency key …>``.
Not covered: ``task_send_sent_event`` builds its ``task-sent`` event before the
signal, from what the sender gave (``apply_async`` gives the redacted text; a bare
``send_task`` does not), and a result backend with ``result_extended`` stores the
real arguments.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery.signals import before_task_publish

log = logging.getLogger("idemmail_celery")

KEY_HEADER = "idempotency_key"
ARGSREPR = "<redacted>"

_lock = threading.Lock()
#: task name -> does it redact? (a callable: settings are resolved lazily, at publish time)
_tasks: dict[str, Callable[[], bool]] = {}


def register(name: str, redacts: Callable[[], bool] | bool = True) -> None:
    """Redact the arguments of every message of task ``name`` (``redacts``: a flag or a callable)."""
    with _lock:
        _tasks[name] = redacts if callable(redacts) else (lambda: bool(redacts))


def kwargsrepr(key: Any) -> str:
    """What a redacted message shows in place of its keyword arguments."""
    return f"<redacted: idempotency key {key}>" if key else "<redacted>"


def redacts(name: str | None, headers: dict[str, Any]) -> bool:
    """Should a message of task ``name`` with these headers be redacted?"""
    check = _tasks.get(name or "")
    if check is None:
        return KEY_HEADER in headers  # an idempotent task this process does not know
    try:
        return check()
    except Exception as exc:  # a broken setting: redact (it also fails at apply_async, loudly)
        log.debug("idemmail: redaction setting for %s failed: %s", name, exc)
        return True


def _on_before_publish(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    if not headers:
        return
    args_done = str(headers.get("argsrepr") or "").startswith("<redacted")
    kwargs_done = str(headers.get("kwargsrepr") or "").startswith("<redacted")
    if (args_done and kwargs_done) or not redacts(sender, headers):  # apply_async redacted it already
        return
    if not args_done:
        headers["argsrepr"] = ARGSREPR
    if not kwargs_done:
        headers["kwargsrepr"] = kwargsrepr(headers.get(KEY_HEADER))


before_task_publish.connect(_on_before_publish, weak=False)
