"""Start-up and outage diagnostics: a set-up problem (a missing driver or API key, a broken install) or an
unreachable ledger is said at ERROR once per process and problem, with the fix; each delivery then reports lower.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ._common import logsafe
from .errors import ConfigurationError, LedgerLostError
from .redaction import scrub

log = logging.getLogger("idemmail_celery")


#: The optional extra that installs each driver a ledger or provider imports on demand.
EXTRA_OF_MODULE = {"psycopg": "postgres", "psycopg2": "postgres", "pymysql": "mysql", "MySQLdb": "mysql",
                   "redis": "redis", "hiredis": "redis", "prometheus_client": "metrics", "cryptography": "crypto"}


def setup_fix(exc: BaseException) -> str:
    """What an operator does about a set-up error, in one sentence."""
    missing = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
    root = str(missing or "").split(".")[0]
    if root in ("psycopg2", "MySQLdb"):  # a URL without a driver name: SQLAlchemy's default driver, not the extra's
        scheme = "postgresql+psycopg" if root == "psycopg2" else "mysql+pymysql"
        return (f"install the driver: pip install 'idemmail-celery[{EXTRA_OF_MODULE[root]}]' and name it in the "
                f"ledger URL ({scheme}://...), then restart the worker")
    if root in EXTRA_OF_MODULE:
        return f"install the driver: pip install 'idemmail-celery[{EXTRA_OF_MODULE[root]}]', then restart the worker"
    if isinstance(exc, ImportError):
        return f"install the missing module {missing or ''} (or repair the install), then restart the worker"
    if isinstance(exc, ConfigurationError):
        return "fix the configuration as it says, then restart the worker"
    return "a defect or a broken install: see the traceback, fix it and restart the worker"


#: What this process has said once: set-up problems, and ledgers found unreachable (by ``id``).
_said_setup: set[tuple[str, str]] = set()
_said_unreachable: set[int] = set()
_said_lock = threading.Lock()


def say_setup_error_once(exc: BaseException, what: str = "tasks cannot be set up on this worker") -> None:
    """One ERROR line per process and problem, with its fix (:func:`setup_fix`); each delivery then
    reports ``setup_error`` at WARNING."""
    problem = (type(exc).__name__, str(exc)[:200])
    with _said_lock:
        if problem in _said_setup:
            return
        _said_setup.add(problem)
    log.error("idemmail: %s (%s: %s): %s; messages wait on the outage budget (idemmail_outage_max_retries) "
              "and are sent once it is fixed", logsafe(what), type(exc).__name__, logsafe(scrub(str(exc))[:300]),
              logsafe(setup_fix(exc)),
              exc_info=not isinstance(exc, (ConfigurationError, ImportError)))


def say_unreachable_once(ledger: Any, exc: Exception) -> None:
    """One ERROR line per process and ledger when it stops answering; each delivery then reports INFO."""
    with _said_lock:
        if id(ledger) in _said_unreachable:
            return
        _said_unreachable.add(id(ledger))
    what = "lost (see the CRITICAL log line)" if isinstance(exc, LedgerLostError) else "unreachable"
    log.error("idemmail: ledger %s (%s); tasks retry until it is back", what, logsafe(exc))


def heard_from(ledger: Any) -> None:
    """The ledger answered again: its next outage gets its ERROR line too."""
    if _said_unreachable:
        with _said_lock:
            _said_unreachable.discard(id(ledger))
