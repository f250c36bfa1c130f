"""idemmail-celery: side-effecting Celery tasks, above all email sends, exactly once per intent.

::

    from idemmail_celery import IdempotentTask

    @app.task(base=IdempotentTask, idempotency_key=("to", "order_id"))
    def send_confirmation(to, order_id):
        ...
"""

from __future__ import annotations

from .bulk import send_campaign
from .config import Settings
from .email import Attachment, EmailMessage
from .errors import (
    AmbiguousSendError,
    ConfigurationError,
    IdemmailError,
    IdempotencyInFlightError,
    IdempotencyKeyError,
    IdempotencyKeyReuseError,
    IllegalTransitionError,
    InvalidEmail,
    LedgerError,
    LedgerLostError,
    LedgerUnavailableError,
    PayloadKeyError,
    PermanentSendError,
    RecordNotFoundError,
    SendError,
    SendNeedsReview,
    StaleTokenError,
    TransientSendError,
    UnknownLedgerSchemeError,
    UnsafeLedgerError,
    UnserializableArgumentsError,
)
from .ledger import ClaimStatus, Ledger, Record, State, from_url
from .mail import send_email
from .task import IdempotentTask

__version__ = "0.1.0"

__all__ = [
    "AmbiguousSendError",
    "Attachment",
    "ClaimStatus",
    "ConfigurationError",
    "EmailMessage",
    "IdemmailError",
    "IdempotencyInFlightError",
    "IdempotencyKeyError",
    "IdempotencyKeyReuseError",
    "IdempotentTask",
    "IllegalTransitionError",
    "InvalidEmail",
    "Ledger",
    "LedgerError",
    "LedgerLostError",
    "LedgerUnavailableError",
    "PayloadKeyError",
    "PermanentSendError",
    "Record",
    "RecordNotFoundError",
    "SendError",
    "SendNeedsReview",
    "Settings",
    "StaleTokenError",
    "State",
    "TransientSendError",
    "UnknownLedgerSchemeError",
    "UnsafeLedgerError",
    "UnserializableArgumentsError",
    "__version__",
    "from_url",
    "send_campaign",
    "send_email",
]
