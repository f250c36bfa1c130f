"""The exception tree of idemmail-celery: every exception the library raises, in this one module.

Every error derives from :class:`IdemmailError`, so a caller can catch at the level it cares about.
Names say what happened; docstrings say what the caller should do about it. The modules that raise
an error also export it under their own name (``idemmail_celery.webhooks.WebhookSignatureError`` is
this module's class)::

    IdemmailError
        ConfigurationError
            UnknownLedgerSchemeError
            UnsafeLedgerError (also LedgerError)
        IdempotencyKeyError
            UnserializableArgumentsError
        InvalidEmail (also ValueError)
        ToolArgumentError (also TypeError)
        SlotMissingError (also ValueError)
        IdempotencyKeyReuseError
        LedgerError
            LedgerUnavailableError
                LedgerLostError
            StaleTokenError
            RecordNotFoundError (also KeyError)
            IllegalTransitionError
            PayloadKeyError
        WebhookSignatureError
        WebhookPayloadError (also ValueError)
        SendError
            PermanentSendError
            TransientSendError
            AmbiguousSendError
            SendNeedsReview
        IdempotencyInFlightError
"""

from __future__ import annotations


class IdemmailError(Exception):
    """Base class of every error raised by idemmail-celery."""


# -- configuration and input: raised in the caller's process, before enqueueing --


class ConfigurationError(IdemmailError):
    """A setting or task option is wrong. Fix the configuration; nothing was enqueued."""


class UnknownLedgerSchemeError(ConfigurationError):
    """The ledger URL names a scheme no ledger backend registers."""


class IdempotencyKeyError(IdemmailError):
    """The intent key cannot be derived from the task call (missing field, bad value).

    Raised at ``delay()``/``apply_async()`` time, before anything is enqueued.
    """


class InvalidEmail(IdemmailError, ValueError):
    """The message cannot be sent as given (bad address, header injection, no recipient, too big).

    Raised by ``send_email.delay()`` before anything is enqueued; ``field`` names the culprit.
    A message that reaches a worker anyway ends as ``failed`` with this reason, not retried.
    """

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message, field)
        self.field = field

    def __str__(self) -> str:
        return str(self.args[0])


class UnserializableArgumentsError(IdempotencyKeyError):
    """The task arguments do not survive the task serializer's round trip."""


class ToolArgumentError(IdemmailError, TypeError):
    """A tool call's arguments do not fit the tool's schema (an unknown or bound name, a missing one).

    Raised before anything is enqueued; ``field`` names the culprit. The agent sees ``invalid``.
    """

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message, field)
        self.field = field

    def __str__(self) -> str:
        return str(self.args[0])


class SlotMissingError(IdemmailError, ValueError):
    """The task knows no slot: it was not sent by a slot-aware beat and no ``slot=`` was given.

    Pass the slot explicitly (``task.delay(slot="2026-11-21")``) when running it by hand,
    or run beat with :class:`SlotScheduler` (or a scheduler with :class:`SlotMixin`).
    """


class IdempotencyKeyReuseError(IdemmailError):
    """A key was reused with different values in fields the task marks as must-match.

    Like an API that rejects a reused idempotency key with other parameters: the
    first payload stays the one that counts, and this duplicate is refused.
    """

    def __init__(self, message: str, key: str = "", fields: tuple[str, ...] | list[str] = ()) -> None:
        # Everything in args: Celery rebuilds a task's exception as cls(*args) in the caller.
        super().__init__(message, key, list(fields))
        self.key = key
        self.fields = tuple(fields)

    def __str__(self) -> str:
        return str(self.args[0])


# -- ledger --


class LedgerError(IdemmailError):
    """Base class of ledger errors."""


class UnsafeLedgerError(ConfigurationError, LedgerError):
    """The ledger store is configured in a way that could silently reopen keys.

    For example a Redis server whose ``maxmemory-policy`` evicts keys: an evicted
    ``sent`` record turns the next duplicate into a second send. A :class:`LedgerError` too: a
    task meeting it fails closed as when the store is down (rescheduled, nothing sent), and says its fix.
    """


class LedgerUnavailableError(LedgerError):
    """The ledger store cannot be reached. Tasks fail closed: they retry, nothing is sent."""


class LedgerLostError(LedgerUnavailableError):
    """The ledger store lost its records, or some of them: flushed, or restarted without persistence.

    Detected by the Redis ledger's epoch markers. Tasks fail closed as when the store
    is unreachable (rescheduled, nothing sent) until an operator checks the store and
    runs ``celery -A proj idemmail ledger ack-loss --note ...``. Intents recorded
    before the loss are then forgotten: a duplicate of one of them sends again.
    """


class StaleTokenError(LedgerError):
    """A transition was attempted with a fencing token that no longer holds the claim.

    The caller's lease expired and another worker reclaimed the intent; the
    newer holder's record wins.
    """


class RecordNotFoundError(LedgerError, KeyError):
    """No ledger record exists for the key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class IllegalTransitionError(LedgerError):
    """An operator asked for a state change the state machine does not allow."""


class PayloadKeyError(LedgerError):
    """A stored payload, result or error was sealed with a key this process does not hold.

    The key was removed from ``idemmail_payload_keys`` while records sealed with it
    remained, or the record comes from another deployment. Nothing is sent: a claim
    that finds such a record parks it as ``review`` (reason ``payload_key_unknown``).
    Put the old key back, after the current one, then resolve the record.
    """


# -- webhooks: raised to the web framework, which answers the provider --


class WebhookSignatureError(IdemmailError):
    """The webhook request is not authenticated (no credentials, wrong ones, a stale timestamp).

    Nothing was read from it and the ledger is unchanged. Answer 401.
    """


class WebhookPayloadError(IdemmailError, ValueError):
    """The webhook body is not what the provider sends (not JSON, too deep, wrong shape). Answer 400."""


# -- outcomes of a send, raised by task bodies and replayed to duplicates --


class SendError(IdemmailError):
    """Base class of outcomes a task body reports about its side effect.

    ``reason`` is a short machine-readable word (``"invalid_recipient"``,
    ``"auth"``, ``"retries_exhausted"``...) stored in the ledger and replayed.
    """

    def __init__(self, message: str = "", reason: str = "", key: str = "", retry_after: float | None = None) -> None:
        message = message or reason or type(self).__name__
        # Everything in args: Celery rebuilds a task's exception as cls(*args) in the
        # caller (JSON result serializer), so .reason, .key and .retry_after survive the trip.
        super().__init__(message, reason or "unspecified", key, retry_after)
        self.message = message
        self.reason = reason or "unspecified"
        self.key = key
        #: Seconds the service asked us to wait before trying again (Retry-After), if it said.
        self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message

    def with_key(self, key: str) -> SendError:
        """Attach the intent key (kept in ``args`` so it survives serialization)."""
        self.key = key
        self.args = (self.message, self.reason, key, self.retry_after)
        return self


class PermanentSendError(SendError):
    """The side effect failed for good (a rejected recipient, a malformed message).

    Recorded as ``failed``; every duplicate gets this same error back; never retried.
    """


class TransientSendError(SendError):
    """The side effect failed and it is known that nothing left the process.

    The claim is released and the task retried with backoff until its retry deadline
    (``idemmail_retry_deadline_seconds`` after the first enqueue, whatever ``max_retries``
    says); then the intent is parked as ``failed`` with reason ``retry_deadline`` and its
    stored payload, ready to re-enqueue. ``retry_after`` (seconds), when the provider said
    so, is the least wait.
    """


class AmbiguousSendError(SendError):
    """The side effect may or may not have happened (a timeout after the request was written).

    If the task carries the key downstream (``idempotency_carries_key=True``) it is
    retried with the same key; otherwise the intent is parked for review.
    """


class SendNeedsReview(SendError):
    """The intent's outcome cannot be known; it is parked as ``review`` for a person.

    Never retried automatically: resolve it with the ledger API or the CLI.
    """


class IdempotencyInFlightError(IdemmailError):
    """Another worker still holds a live claim on this intent after the in-flight budget ran out.

    The holder's own delivery (``acks_late``) still carries the intent, so
    nothing is lost; this copy gives up.
    """


SEND_ERRORS: dict[str, type[SendError]] = {
    cls.__name__: cls
    for cls in (SendError, PermanentSendError, TransientSendError, AmbiguousSendError, SendNeedsReview)
}
