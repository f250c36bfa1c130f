"""What a worker does for idempotent tasks at start and at shutdown (Celery's worker signals).

At ``worker_init`` (main process, before the pool forks): every idempotent task's settings, key secret,
ledger and provider are checked once (:func:`start_up_problems`), the key-secret roster heartbeat starts in
the background (:func:`announcer`), and glibc's malloc is told not to keep freed message bodies. At
``celeryd_after_setup`` each problem found is logged at ERROR once, with its fix (or the worker refuses to
start, ``idemmail_refuse_to_start``). At ``worker_shutdown`` the worker leaves the rosters at once.
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
    """What would keep this worker's idempotent tasks from running, checked once at start: each task's
    settings, its key secret, its ledger (its driver imports, it opens and answers) and, for tasks with
    a provider (``send_email``), that the provider builds. A list of (task name, error); empty when all pass.

    Opening the ledgers here also reads what pool children must inherit (the Redis ledger's epoch):
    a child that first met the store after it was emptied would take it for a new ledger and send again.
    """
    problems: list[tuple[str, BaseException]] = []
    seen: set[int] = set()
    for task in list(app.tasks.values()):
        if not isinstance(task, IdempotentTask):
            continue
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
    """On ``worker_init`` (main process, before the pool forks): :func:`start_up_problems`, kept for
    :func:`_report_at_start` (Celery's logging is not set up yet). Never raises."""
    app = getattr(sender, "app", None)
    if app is not None:
        _found_at_start[id(app)] = start_up_problems(app)
        # In the background: a ledger down or slow must not hold the start-up. Claims wait for it instead
        # (IdempotentTask.ensure_announced), in every process of the worker.
        roster.running[id(app)] = announcer(app).start()


def announcer(app: Any) -> roster.Announcer:
    """This worker's heartbeat into the key-secret roster of each ledger its idempotent tasks use, with the
    ids of the secrets all of that ledger's tasks hold (:mod:`idemmail_celery.roster`)."""
    held: dict[int, tuple[Ledger, list[str]]] = {}
    for task in list(app.tasks.values()):
        if not isinstance(task, IdempotentTask):
            continue
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
    """On ``celeryd_after_setup`` (``celery worker``: logging set up, the pool not started, before ``ready``):
    one ERROR line with its fix per start-up problem. Messages then wait on the outage budget until it is
    fixed; with ``idemmail_refuse_to_start`` the worker exits instead."""
    app = getattr(instance, "app", None)
    problems = _found_at_start.pop(id(app), []) if app is not None else []
    for name, exc in problems:
        # The store is down now (not set up unsafely: that is a fix to make): the first claim finds out again.
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
    """On ``worker_init`` (main process, before the pool forks): :func:`idemmail_celery._memory.fix_mmap_threshold`."""
    from ._memory import fix_mmap_threshold

    fix_mmap_threshold()


# outcomes (imported by task) connected its worker_init handler first: metrics are on before this opens ledgers.
worker_init.connect(_check_at_start, weak=False)
worker_init.connect(_fix_mmap_threshold, weak=False)
celeryd_after_setup.connect(_report_at_start, weak=False)
worker_shutdown.connect(_leave_at_shutdown, weak=False)
