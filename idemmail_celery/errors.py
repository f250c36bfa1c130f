"""The exception tree of idemmail-celery: every exception the library raises, in this one module.

Every error derives from :class:`IdemmailError`, so a caller can catch at the level it cares about.
Modules that raise an error may also export it under their own name::

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
    """The intent key cannot be derived from the task call (missing field, bad value); nothing was enqueued."""


class InvalidEmail(IdemmailError, ValueError):
    """The message cannot be sent as given; ``field`` names the culprit. Raised at ``send_email.delay()``,
    before anything is enqueued; a message that reaches a worker anyway ends ``failed``, not retried."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message, field)
        self.field = field

    def __str__(self) -> str:
        return str(self.args[0])


class UnserializableArgumentsError(IdempotencyKeyError):
    """The task arguments do not survive the task serializer's round trip."""


class ToolArgumentError(IdemmailError, TypeError):
    """A tool call's arguments do not fit the tool's schema; ``field`` names the culprit. Nothing was enqueued."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message, field)
        self.field = field

    def __str__(self) -> str:
        return str(self.args[0])


class SlotMissingError(IdemmailError, ValueError):
    """The task knows no slot: pass ``slot=`` when running it by hand, or run beat with ``SlotScheduler``."""


class IdempotencyKeyReuseError(IdemmailError):
    """A key was reused with different values in must-match fields: the first payload counts, this one is refused."""

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
    """The ledger store could silently reopen keys (a Redis that evicts keys). Tasks fail closed; the message
    says the fix."""


class LedgerUnavailableError(LedgerError):
    """The ledger store cannot be reached. Tasks fail closed: they retry, nothing is sent."""


class LedgerLostError(LedgerUnavailableError):
    """The ledger store lost records (flushed, or restarted without persistence): tasks fail closed until an
    operator checks it and runs ``celery -A proj idemmail ledger ack-loss --note ...``."""


class StaleTokenError(LedgerError):
    """The caller's fencing token no longer holds the claim: another worker reclaimed it, and its record wins."""


class RecordNotFoundError(LedgerError, KeyError):
    """No ledger record exists for the key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class IllegalTransitionError(LedgerError):
    """An operator asked for a state change the state machine does not allow."""


class PayloadKeyError(LedgerError):
    """A stored record was sealed with a key not in ``idemmail_payload_keys``: parked as ``review``, nothing
    sent. Put the old key back, after the current one."""


# -- webhooks: raised to the web framework, which answers the provider --


class WebhookSignatureError(IdemmailError):
    """The webhook request is not authenticated; nothing was read from it. Answer 401."""


class WebhookPayloadError(IdemmailError, ValueError):
    """The webhook body is not what the provider sends (not JSON, too deep, wrong shape). Answer 400."""


# -- outcomes of a send, raised by task bodies and replayed to duplicates --


class SendError(IdemmailError):
    """Base class of outcomes a task body reports; ``reason`` is a short machine-readable word, stored and replayed."""

    def __init__(self, message: str = "", reason: str = "", key: str = "", retry_after: float | None = None) -> None:
        message = message or reason or type(self).__name__
        # Everything in args: Celery rebuilds a task's exception as cls(*args) in the caller.
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
    """The side effect failed for good: recorded as ``failed``, replayed to every duplicate, never retried."""


class TransientSendError(SendError):
    """The side effect failed and nothing left the process: retried with backoff (at least ``retry_after``)
    until ``idemmail_retry_deadline_seconds`` after the first enqueue, then ``failed`` (``retry_deadline``)."""


class AmbiguousSendError(SendError):
    """The side effect may have happened: retried with the same key if the task carries it downstream
    (``idempotency_carries_key=True``), else parked for review."""


class SendNeedsReview(SendError):
    """The intent's outcome cannot be known: parked as ``review``, for a person to resolve (ledger API, CLI)."""


class IdempotencyInFlightError(IdemmailError):
    """Another worker still holds the claim after the in-flight budget ran out; its delivery carries the intent."""


SEND_ERRORS: dict[str, type[SendError]] = {
    cls.__name__: cls
    for cls in (SendError, PermanentSendError, TransientSendError, AmbiguousSendError, SendNeedsReview)
}
