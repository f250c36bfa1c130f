"""idemmail-celery: side-effecting Celery tasks, above all email sends, exactly once per intent.

::

    from idemmail_celery import IdempotentTask, send_email

    @app.task(base=IdempotentTask, idempotency_key=("to", "order_id"))
    def send_confirmation(to, order_id):
        ...

The public surface is what this module exports: the task base class, the ready-made ``send_email`` and
``send_campaign`` tasks, the ledger and provider factories, and the errors a caller catches.

``send_email`` and ``send_campaign`` register themselves on every app when first imported from here, not before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The worker signals (re-drive, start-up checks, roster heartbeat) act only where an app has an idempotent task.
from . import redrive as _redrive  # noqa: F401
from . import worker as _worker  # noqa: F401
from .errors import (
    AmbiguousSendError,
    ConfigurationError,
    IdemmailError,
    IdempotencyInFlightError,
    IdempotencyKeyError,
    IdempotencyKeyReuseError,
    InvalidEmail,
    LedgerError,
    LedgerUnavailableError,
    PermanentSendError,
    SendError,
    SendNeedsReview,
    TransientSendError,
)
from .ledger import from_url as ledger_from_url
from .providers import from_url as provider_from_url
from .task import IdempotentTask

if TYPE_CHECKING:
    from celery import Task

    from .mail import SendEmailTask

    send_email: SendEmailTask
    send_campaign: Task

from ._version import __version__

__all__ = [
    "AmbiguousSendError", "ConfigurationError", "IdemmailError", "IdempotencyInFlightError", "IdempotencyKeyError",
    "IdempotencyKeyReuseError", "IdempotentTask", "InvalidEmail", "LedgerError", "LedgerUnavailableError",
    "PermanentSendError", "SendError", "SendNeedsReview", "TransientSendError", "__version__", "ledger_from_url",
    "provider_from_url", "send_campaign", "send_email",
]


def __getattr__(name: str) -> Any:
    # The two shared tasks register on every app when their module is imported: only when asked for.
    if name == "send_email":
        from .mail import send_email

        return send_email
    if name == "send_campaign":
        from .bulk import send_campaign

        return send_campaign
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
