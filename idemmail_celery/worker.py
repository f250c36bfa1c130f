"""What a worker does for idempotent tasks at start and at shutdown (Celery's worker signals): the start-up
checks (:func:`start_up_problems`, see docs/deployment.md) and the key-secret roster heartbeat (:func:`announcer`).
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import celeryd_after_setup, worker_init, worker_shutdown

from . import keys as keys_mod
from . import roster
from ._common import logsafe
from .config import Settings
from .diagnostics import say_setup_error_once
from .errors import ConfigurationError, LedgerError
from .ledger import Ledger
from .ledger.base import default_owner
from .redaction import scrub
from .task import IdempotentTask

log = logging.getLogger("idemmail_celery")


def start_up_problems(app: Any) -> list[tuple[str, BaseException]]:
    """What would keep this worker's idempotent tasks from running, as (task name, error). Opening the ledgers here
    also reads what pool children must inherit (the Redis ledger's epoch)."""
    problems: list[tuple[str, BaseException]] = []
    seen: set[int] = set()
    for task in [t for t in list(app.tasks.values()) if isinstance(t, IdempotentTask)]:
        try:
            settings = task.idem_settings
            if not (settings.key_secrets or settings.allow_plain_keys or settings.ledger_url.startswith("sqlite")):
                raise ConfigurationError("idemmail_key_secret is not set: set it (or IDEMMAIL_KEY_SECRET)")
            ledger = task.ledger
            if id(ledger) not in seen:
                seen.add(id(ledger))
                ledger.prepare()
                ledger.ping()  # a SQL ledger imports its driver on first use: here, not at the first message
            if settings.provider_url and hasattr(task, "provider"):
                task.provider  # noqa: B018 - a provider without its API key, or its module missing
        except Exception as exc:
            problems.append((task.name, exc))
    return problems


_found_at_start: dict[int, list[tuple[str, BaseException]]] = {}


def _check_at_start(sender: Any = None, **_: Any) -> None:
    """On ``worker_init`` (before the pool forks): :func:`start_up_problems`, kept for :func:`_report_at_start`."""
    app = getattr(sender, "app", None)
    if app is not None:
        _found_at_start[id(app)] = start_up_problems(app)
        # In the background: a ledger down must not hold the start-up (claims wait: ensure_announced).
        roster.running[id(app)] = announcer(app).start()


def announcer(app: Any) -> roster.Announcer:
    """This worker's heartbeat into the key-secret roster of each ledger, with the secrets all its tasks hold."""
    held: dict[int, tuple[Ledger, list[str]]] = {}
    for task in [t for t in list(app.tasks.values()) if isinstance(t, IdempotentTask)]:
        try:
            ledger, ids = task.ledger, keys_mod.secret_ids(task.idem_settings.key_secrets or None)
        except Exception:  # settings that do not parse: reported by start_up_problems
            continue
        found = held.get(id(ledger))
        held[id(ledger)] = (ledger, list(ids) if found is None else [i for i in found[1] if i in ids])
    return roster.Announcer(default_owner(), [(ledger, ids) for ledger, ids in held.values() if ids])


def _leave_at_shutdown(sender: Any = None, **_: Any) -> None:
    """On ``worker_shutdown``: out of the rosters at once, rather than when the entry lapses."""
    app = getattr(sender, "app", None)
    found = roster.running.pop(id(app), None) if app is not None else None
    if found is not None:
        found.stop()


def _report_at_start(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """On ``celeryd_after_setup``: one ERROR per start-up problem, with its fix (``idemmail_refuse_to_start``: exit)."""
    app = getattr(instance, "app", None)
    problems = _found_at_start.pop(id(app), []) if app is not None else []
    for name, exc in problems:
        if isinstance(exc, LedgerError) and not isinstance(exc, ConfigurationError):
            log.error("idemmail: start-up check of %s failed (%s: %s): start the ledger's store or correct "
                      "idemmail_ledger_url; messages wait until it answers", logsafe(name), type(exc).__name__,
                      logsafe(scrub(str(exc))[:300]))
        else:  # said once per process: pool children forked after this do not say it again per message
            say_setup_error_once(exc, f"start-up check of {name} failed")
    if problems and app is not None:
        try:
            refuse = Settings.resolve(app.conf).refuse_to_start
        except ConfigurationError:
            refuse = False
        if refuse:
            raise SystemExit(f"idemmail: refusing to start: {len(problems)} start-up check(s) failed (see the "
                             "ERROR lines above); idemmail_refuse_to_start is set")


def _fix_mmap_threshold(**_: Any) -> None:
    """On ``worker_init``: :func:`idemmail_celery._memory.fix_mmap_threshold`."""
    from ._memory import fix_mmap_threshold

    fix_mmap_threshold()


# outcomes (imported by task) connected its worker_init handler first: metrics are on before this opens ledgers.
worker_init.connect(_check_at_start, weak=False)
worker_init.connect(_fix_mmap_threshold, weak=False)
celeryd_after_setup.connect(_report_at_start, weak=False)
worker_shutdown.connect(_leave_at_shutdown, weak=False)
