"""``IdempotentTask``: the state machine that makes a task run once per intent.

Read top to bottom, this module is the guarantee:

* ``apply_async`` (caller's process) derives the intent key before anything is
  enqueued and sends it as the ``idempotency_key`` header; bad input fails here.
* ``__call__`` (worker) claims the key in the ledger, then by what the ledger says:

  ===========================  ==============================================================
  ledger answer                what happens
  ===========================  ==============================================================
  new key                      run the body, record ``sent`` with its result, return it
  released claim               run the *stored first payload*, as above
  ``sent``                     do not run; return the stored result (status ``duplicate``)
  ``failed``                   do not run; raise the stored :class:`PermanentSendError`
  ``review``                   do not run; raise :class:`SendNeedsReview`
  live claim of another        reschedule with backoff (own budget), then replay
  expired claim (holder died)  key carried downstream: run again with the same key and the
                               stored payload; otherwise park as ``review``, do not send
  ===========================  ==============================================================

* what the body raises decides the record: :class:`TransientSendError` releases the
  claim and retries; :class:`PermanentSendError` records ``failed``;
  :class:`AmbiguousSendError` and any unexpected exception mean "maybe sent":
  retried with the same key when the key travels downstream, parked as
  ``review`` otherwise. Nothing is ever dropped: every exhausted budget parks
  the record with its payload.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import inspect
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Retry
from celery.signals import worker_init

from . import keys as keys_mod
from . import metrics as _metrics
from . import outcomes, redaction
from ._lease import keeper
from .config import Settings
from .errors import (
    SEND_ERRORS,
    AmbiguousSendError,
    ConfigurationError,
    IdempotencyInFlightError,
    IdempotencyKeyReuseError,
    LedgerError,
    LedgerLostError,
    LedgerUnavailableError,
    PayloadKeyError,
    PermanentSendError,
    SendError,
    SendNeedsReview,
    StaleTokenError,
    TransientSendError,
    UnsafeLedgerError,
    UnserializableArgumentsError,
)
from .keys import IntentKeyBuilder, KeySpec, Payload
from .ledger import Claim, ClaimRequest, ClaimStatus, Ledger, Record, State, backend_for, from_url
from .ledger.base import new_owner
from .ledger.sealed import PAYLOAD_KEY_UNKNOWN, is_sealed, park_unreadable

log = logging.getLogger("idemmail_celery")

KEY_HEADER = "idempotency_key"
TENANT_HEADER = "idempotency_tenant"
INFLIGHT_HEADER = "idemmail_inflight"
OUTAGE_HEADER = "idemmail_outage"
ENQUEUED_HEADER = "idemmail_enqueued"  # when the intent was first enqueued (caller's clock, epoch seconds)

#: After an acknowledged ledger loss, a message that does not say when it was enqueued (sent by
#: name, or by an older version) counts as possibly older than the loss for this long.
UNDATED_AFTER_LOSS_SECONDS = 24 * 3600.0

_ledgers: dict[tuple[str, str], Ledger] = {}
_ledgers_lock = threading.Lock()
_reported_unreachable: set[str] = set()
_warned_no_secret = False


def get_ledger(url: str, options: dict[str, Any] | None = None) -> Ledger:
    """The process-wide ledger for ``url`` (one connection pool per URL and options)."""
    # A digest, not the options: they hold the payload keys, which must not sit in a dict key.
    cache_key = (url, hashlib.sha256(repr(sorted((options or {}).items())).encode()).hexdigest())
    with _ledgers_lock:
        ledger = _ledgers.get(cache_key)
        if ledger is None:
            ledger = _ledgers[cache_key] = _metrics.watch(from_url(url, **(options or {})))
        return ledger


def backoff(attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter: between half and all of ``min(cap, base * 2**attempt)``."""
    ceiling = min(cap, base * (2 ** min(attempt, 30)))
    return float(ceiling * random.uniform(0.5, 1.0))


def _error_record(exc: BaseException, reason: str, state_type: type[SendError]) -> dict[str, Any]:
    return {
        "type": state_type.__name__,
        "reason": reason,
        "message": str(exc)[:500],
        "cause": type(exc).__name__,
        "at": time.time(),
    }


def _iso(ts: float | None) -> str | None:
    return None if not ts else dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat()


class IdempotentTask(Task):  # type: ignore[misc]
    """Base class for tasks whose side effect must happen once per intent.

    Use it as ``@app.task(base=IdempotentTask, idempotency_key=("to", "order_id"))``.

    Task options (all optional):

    ``idempotency_key``
        Argument names that make up the intent, or a function
        ``(args, kwargs) -> str``. Default: every bound argument.
    ``idempotency_tenant``
        Argument whose value namespaces the key (or pass ``idempotency_tenant=``
        to ``apply_async``).
    ``idempotency_version``
        Bump it (default 1) to deliberately send every intent again.
    ``idempotency_must_match``
        Arguments a duplicate must repeat exactly; a differing duplicate raises
        :class:`IdempotencyKeyReuseError` instead of replaying.
    ``idempotency_address_fields``
        Arguments normalised as email addresses (default: ``to``, ``cc``,
        ``bcc``, ``reply_to``, ``from_``, ``sender`` where present).
    ``idempotency_carries_key``
        True if the body passes ``self.request.idempotency_key`` downstream to a
        service that de-duplicates on it: then a crashed or ambiguous attempt
        is safely retried instead of parked for review.
    ``idempotency_redact_args``
        True (the default) shows the intent key instead of the arguments (addresses,
        bodies) wherever Celery shows them: task events, Flower, worker logs
        (``argsrepr`` and ``kwargsrepr``), on every publish path (``apply_async``,
        ``send_task``, the outbox relay; see :mod:`idemmail_celery.redaction`).
        False shows them. Default: the app setting ``idemmail_redact_args``, else True.

    plus the per-task settings listed in :mod:`idemmail_celery.config`.

    The body reads its key as ``self.request.idempotency_key``. Callers pass an
    explicit key with ``apply_async(..., idempotency_key="order-4821:confirm")``.
    Calling the task function directly (``task(...)``) runs the body without
    the ledger, as Celery does for any task.
    """

    abstract = True
    acks_late = True
    reject_on_worker_lost = True

    idempotency_key: KeySpec = None
    idempotency_tenant: str | None = None
    idempotency_version: int = 1
    idempotency_must_match: Sequence[str] = ()
    idempotency_address_fields: Sequence[str] | None = None
    idempotency_carries_key: bool | None = None
    idempotency_ledger_url: str | None = None
    idempotency_lease_seconds: float | None = None
    idempotency_max_reclaims: int | None = None
    idempotency_inflight_max_retries: int | None = None
    idempotency_fail_open: bool | None = None
    idempotency_redact_args: bool | None = None

    _idem_settings: Settings | None = None
    _idem_builder: IntentKeyBuilder | None = None
    _idem_ledger: Ledger | None = None

    # -- configuration, resolved once per task --

    @property
    def idem_settings(self) -> Settings:
        """This task's resolved :class:`~idemmail_celery.config.Settings`."""
        if self._idem_settings is None:
            self._idem_settings = Settings.resolve(self.app.conf, self)
        return self._idem_settings

    @property
    def key_builder(self) -> IntentKeyBuilder:
        """The :class:`~idemmail_celery.keys.IntentKeyBuilder` for this task."""
        if self._idem_builder is None:
            self._check_options()
            signature = inspect.signature(self.run)
            spec = self.idempotency_key
            if isinstance(spec, list):
                spec = tuple(spec)
            self._idem_builder = IntentKeyBuilder(
                task_name=self.name,
                signature=signature,
                spec=spec,
                tenant_field=self.idempotency_tenant,
                version=self.idempotency_version,
                address_fields=keys_mod.address_fields_for(signature, self.idempotency_address_fields),
                must_match=tuple(self.idempotency_must_match or ()),
                serializer=self.serializer or self.app.conf.task_serializer or "json",
                secret=self.idem_settings.key_secret,
            )
        return self._idem_builder

    def _check_options(self) -> None:
        global _warned_no_secret
        settings = self.idem_settings
        backend_for(settings.ledger_url)  # unknown scheme: raise now, in the caller
        unsafe = [
            exc for exc in (getattr(self, "autoretry_for", None) or ())
            if not (isinstance(exc, type) and issubclass(exc, TransientSendError))
        ]
        if unsafe:
            raise ConfigurationError(
                f"{self.name}: autoretry_for={unsafe!r} would retry sends that may have gone out; "
                "raise TransientSendError (retried) or AmbiguousSendError (made safe) instead"
            )
        if settings.key_secret is None and not _warned_no_secret:
            _warned_no_secret = True
            log.warning(
                "idemmail: no idemmail_key_secret set; intent keys are plain SHA-256 and can be "
                "brute-forced back to guessable arguments. Set idemmail_key_secret in production."
            )

    def carries_key(self) -> bool:
        """Does the side effect pass the key to a service that de-duplicates on it?

        Decides whether a crashed or ambiguous attempt is retried with the same key
        (True) or parked for review (False). Subclasses whose downstream is chosen
        at run time (``send_email`` asks its provider) override this.
        """
        return self.idem_settings.carries_key

    @property
    def ledger(self) -> Ledger:
        """The ledger this task claims in (one per process and URL; backends survive forks)."""
        if self._idem_ledger is None:
            s = self.idem_settings
            self._idem_ledger = get_ledger(s.ledger_url, s.ledger_kwargs())
        return self._idem_ledger

    # -- the caller's side --

    def intent_key(self, *args: Any, **kwargs: Any) -> str:
        """The key ``apply_async(args, kwargs)`` would derive (for tests and operators)."""
        return self.key_builder.derive(self.key_builder.payload(args, kwargs))

    def check_call(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Validate a call before it is accepted (a hook: ``send_email`` checks the message here).

        Raise a typed error; nothing has been enqueued or written yet.
        """

    def intent_headers(
        self, args: Any = None, kwargs: Any = None, *, explicit: str | None = None, tenant: str | None = None
    ) -> dict[str, str]:
        """Validate a call and derive its intent: the message headers it will travel with.

        What ``apply_async`` does before enqueueing, and what the transactional
        outbox stores with a row. Raises :class:`~idemmail_celery.errors.IdemmailError`
        subclasses (and ``TypeError`` from ``check_call``) on bad input.
        """
        if type(self).check_call is not IdempotentTask.check_call:  # the base's accepts everything
            self.check_call(tuple(args or ()), dict(kwargs or {}))
        builder = self.key_builder
        payload = builder.payload(args, kwargs)
        if builder.serializer != "json":
            payload.to_json()  # the ledger stores JSON: fail now if it cannot (json proved it already)
        headers = {KEY_HEADER: builder.derive(payload, explicit=explicit, tenant=tenant),
                   ENQUEUED_HEADER: f"{time.time():.3f}"}
        if tenant is not None:
            headers[TENANT_HEADER] = str(tenant)
        return headers

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Register the task for redaction on every publish path (:mod:`idemmail_celery.redaction`)."""
        super().on_bound(app)
        name = cls.name
        if name:
            def redacts() -> bool:
                task = app.tasks.get(name)
                return True if task is None else bool(task.idem_settings.redact_args)

            redaction.register(name, redacts)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Enqueue like Celery, with the intent key derived first and sent as a header.

        Extra options: ``idempotency_key`` (an explicit key, namespaced and hashed
        like a derived one) and ``idempotency_tenant``. Raises
        :class:`~idemmail_celery.errors.IdempotencyKeyError` (and subclasses) or
        :class:`~idemmail_celery.errors.ConfigurationError` before enqueueing.
        """
        explicit = options.pop("idempotency_key", None)
        tenant = options.pop("idempotency_tenant", None)
        headers = dict(options.get("headers") or {})
        if explicit is not None or KEY_HEADER not in headers:  # a retry already carries its key
            headers.update(self.intent_headers(args, kwargs, explicit=explicit, tenant=tenant))
        options["headers"] = headers
        if self.idem_settings.redact_args:  # the task option, else idemmail_redact_args, parsed strictly
            options.setdefault("argsrepr", "<redacted>")
            options.setdefault("kwargsrepr", f"<redacted: idempotency key {headers[KEY_HEADER]}>")
        return super().apply_async(args, kwargs, **options)

    # -- the worker's side --

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return self.run(*args, **kwargs)
        settings = self.idem_settings
        builder = self.key_builder
        headers = request.headers or {}
        payload = Payload(list(args), dict(kwargs))
        key = headers.get(KEY_HEADER) or getattr(request, KEY_HEADER, None)
        if not key:
            key = builder.derive(payload, tenant=headers.get(TENANT_HEADER))
        request.idempotency_key = key

        ledger = self.ledger
        try:
            claim = ledger.claim(ClaimRequest(
                key=key,
                task_name=self.name,
                payload=payload.to_json(),
                fingerprint=builder.fingerprint(payload),
                owner=new_owner(request.id or ""),
                lease_seconds=settings.lease_seconds,
            ))
        except (LedgerUnavailableError, UnsafeLedgerError) as exc:
            # Fail closed: nothing is sent without a claim, and the message is not lost.
            return self._ledger_down(exc, key, args, kwargs)

        status = claim.status
        if status in (ClaimStatus.REOPENED, ClaimStatus.RECLAIMED) and is_sealed(claim.record.payload):
            self._unreadable(claim)  # this process has no payload keys: never run it, never strand it
        if status is ClaimStatus.DONE:
            self._check_reuse(claim.record, payload)
            return self._replay(claim.record)
        if status is ClaimStatus.BUSY:
            self._check_reuse(claim.record, payload)
            self._reschedule_in_flight(claim.record)
        if status is ClaimStatus.RECLAIMED:
            outcome = self._after_crash(claim)
            if outcome is not None:
                return outcome
        if status is ClaimStatus.ACQUIRED and _older_than(headers, ledger.recovered_at):
            outcome = self._after_loss(claim)
            if outcome is not None:
                return outcome
        # The first payload ships; if an operator erased it (``forget``), this delivery's is all there is.
        first = claim.record.payload
        stored = payload if status is ClaimStatus.ACQUIRED or not first else Payload.from_json(first)
        if status is ClaimStatus.REOPENED:
            try:
                self._check_reuse(claim.record, payload)
            except IdempotencyKeyReuseError:
                ledger.release(key, claim.token)  # nothing ran; the first payload's own retry will
                raise
        return self._run_claimed(claim, stored)

    def _unreadable(self, claim: Claim) -> NoReturn:
        """A held claim whose first payload is sealed, in a process without ``idemmail_payload_keys``.

        Parked as ``review`` (reason ``payload_key_unknown``), as a process with the wrong keys
        does, and :class:`PayloadKeyError` raised; if parking fails, rescheduled as in flight,
        so this delivery meets the record again once the claim's lease runs out.
        """
        key = claim.record.key
        after = park_unreadable(self.ledger, claim)
        if after.status is ClaimStatus.BUSY:
            self._reschedule_in_flight(after.record)
        outcomes.report(self, outcomes.REVIEW, key, reason=PAYLOAD_KEY_UNKNOWN)
        raise PayloadKeyError(
            f"ledger record {key} is sealed but this process has no idemmail_payload_keys (parked for review); "
            "configure the same payload keys as the other workers, then resolve it"
        )

    def _run_claimed(self, claim: Claim, payload: Payload) -> dict[str, Any]:
        """Run the body under the claim and record what came of it."""
        key, token, ledger = claim.record.key, claim.token, self.ledger
        settings = self.idem_settings
        keeper.hold(ledger, key, token, settings.lease_seconds)
        try:
            value = self.run(*payload.args, **payload.kwargs)
        except Retry:
            # The body chose to retry itself: by Celery's contract nothing was sent.
            self._record(ledger.release, key, token, {"reason": "body_retried", "at": time.time()})
            raise
        except PermanentSendError as exc:
            self._record(ledger.fail, key, token, _error_record(exc, exc.reason, type(exc)))
            exc.with_key(key)
            raise
        except SendNeedsReview as exc:
            self._record(ledger.park, key, token, _error_record(exc, exc.reason, SendNeedsReview))
            exc.with_key(key)
            raise
        except TransientSendError as exc:
            return self._retry_or_park(claim, exc, exc.reason, sent_maybe=False)
        except Exception as exc:  # anything else: the side effect may have happened
            reason = exc.reason if isinstance(exc, AmbiguousSendError) else "unexpected_error"
            return self._retry_or_park(claim, exc, reason, sent_maybe=True)
        finally:
            keeper.drop(ledger, key, token)
        return self._record_sent(claim.record, token, value)

    def _record_sent(self, record: Record, token: int, value: Any, *, reconciled: bool = False) -> dict[str, Any]:
        key, ledger = record.key, self.ledger
        stored = {"value": value, "message_id": _message_id(value)}
        unrecorded: str | None = None  # why the ledger does not hold this send, if it does not
        for attempt in range(4):
            try:
                ledger.complete(key, token, stored)
                break
            except UnserializableArgumentsError:
                # The send happened; a result JSON cannot hold must not keep it from being recorded.
                stored = {"value": None, "message_id": None, "unserializable": type(value).__name__}
            except StaleTokenError as exc:
                # Our lease was taken over while we ran. If the newer holder already
                # recorded sent, the intent went out twice: say so loudly.
                log.error("idemmail: %s completed after losing its lease: %s", key, exc)
                unrecorded = "lease_lost"
                break
            except LedgerUnavailableError as exc:
                if attempt == 3:
                    # The send happened; the claim stays with its lease. When it expires the
                    # next claimer resends with the same key or parks it for review.
                    log.error("idemmail: %s was sent but could not be recorded: %s", key, exc)
                    unrecorded = "unrecorded"
                    break
                time.sleep(0.2 * 2**attempt)
        outcome = self._outcome("sent", key, stored, time.time())
        if unrecorded:  # maybe sent twice (lease lost), or a later claimer may send again: said apart
            outcomes.report(self, outcomes.SENT, key, message_id=outcome["message_id"], reason=unrecorded,
                            recorded="false")
        else:
            outcomes.report(self, outcomes.SENT, key, message_id=outcome["message_id"],
                            reason="reconciled" if reconciled else None)
        return outcome

    def _retry_or_park(self, claim: Claim, exc: Exception, reason: str, *, sent_maybe: bool) -> dict[str, Any]:
        """A failed attempt: release and retry while budget and safety allow, else reconcile or park."""
        key, token, ledger = claim.record.key, claim.token, self.ledger
        settings = self.idem_settings
        retry_safe = not sent_maybe or self.carries_key()
        budget_left = self.max_retries is None or self.request.retries < self.max_retries
        if retry_safe and budget_left:
            note = {**_error_record(exc, reason, type(exc) if isinstance(exc, SendError) else SendError),
                    "maybe_sent": sent_maybe}
            self._record(ledger.release, key, token, note)
            countdown = backoff(self.request.retries, settings.retry_backoff, settings.retry_backoff_max)
            if isinstance(exc, SendError) and exc.retry_after:
                countdown = max(countdown, exc.retry_after)
            raise self.retry(exc=exc, countdown=countdown)
        if sent_maybe:
            found = self._reconciled(claim.record)
            if found is not None:
                return self._record_sent(claim.record, token, found, reconciled=True)
            why = "retries_exhausted" if retry_safe else reason
            self._record(ledger.park, key, token, _error_record(exc, why, SendNeedsReview))
            raise SendNeedsReview(f"outcome unknown ({reason}): {exc}", reason=why, key=key) from exc
        self._record(ledger.fail, key, token, _error_record(exc, "retries_exhausted", PermanentSendError))
        raise PermanentSendError(f"gave up after {self.request.retries} retries: {exc}",
                                 reason="retries_exhausted", key=key) from exc

    def _after_crash(self, claim: Claim) -> dict[str, Any] | None:
        """A reclaimed expired lease: its holder died, maybe mid-send."""
        record, settings = claim.record, self.idem_settings
        outcomes.report(self, outcomes.RECLAIMED, record.key, reclaims=record.reclaims)
        if record.reclaims > settings.max_reclaims:
            reason = "reclaim_limit"  # a poison message that kills its worker every time
        elif not self.carries_key():
            found = self._reconciled(record)
            if found is not None:  # the provider has it: record the truth, do not send again
                return self._record_sent(record, claim.token, found, reconciled=True)
            reason = "lease_expired"  # it may have sent, and nothing downstream would dedupe
        else:
            log.warning("idemmail: %s reclaimed after an expired lease; resending with the same key", record.key)
            return None
        message = f"previous holder {record.owner} lost its lease (reclaims: {record.reclaims})"
        self._park_unknown(claim, reason, message)

    def _after_loss(self, claim: Claim) -> dict[str, Any] | None:
        """A new claim for a message enqueued before an acknowledged ledger loss.

        The intent may have been sent and recorded in what was lost. With the key carried
        downstream it is sent with that key (the service de-duplicates); otherwise it is
        reconciled, or parked for review: never sent on a guess.
        """
        if self.carries_key():
            return None
        found = self._reconciled(claim.record)
        if found is not None:
            return self._record_sent(claim.record, claim.token, found, reconciled=True)
        self._park_unknown(claim, "ledger_lost", "enqueued before an acknowledged ledger loss: it may have been "
                                                 "sent, and the record of it lost")

    def _park_unknown(self, claim: Claim, reason: str, message: str) -> NoReturn:
        """Park a claim whose outcome cannot be known, and say so to the caller."""
        key = claim.record.key
        err = {"type": "SendNeedsReview", "reason": reason, "at": time.time(), "message": message}
        self._record(self.ledger.park, key, claim.token, err)
        raise SendNeedsReview(message, reason=reason, key=key)

    def reconcile(self, key: str, payload: Payload) -> Any | None:
        """Ask the side effect's service whether this intent already happened.

        Called before an intent is parked for review (a crashed holder, an ambiguous
        failure). Return the result to record as ``sent`` (what the body would have
        returned), or None when it cannot be found (not proof that it did not happen).
        The default asks nobody.
        """
        return None

    def _reconciled(self, record: Record) -> Any | None:
        try:
            return self.reconcile(record.key, Payload.from_json(record.payload or ""))
        except Exception as exc:  # asking is best effort; review is the safe answer
            log.warning("idemmail: reconciling %s failed: %s", record.key, exc)
            return None

    def _reschedule_in_flight(self, record: Record) -> NoReturn:
        """Another worker holds a live claim: come back later, on a budget of our own."""
        request, settings = self.request, self.idem_settings
        headers = dict(request.headers or {})
        count = int(headers.get(INFLIGHT_HEADER) or 0)
        if count >= settings.inflight_max_retries:
            outcomes.report(self, outcomes.IN_FLIGHT_GAVE_UP, record.key, reschedules=count)
            raise IdempotencyInFlightError(
                f"{record.key} still held by {record.owner} after {count} reschedules"
            )
        headers[INFLIGHT_HEADER] = count + 1
        countdown = backoff(count, settings.inflight_backoff, settings.inflight_backoff_max)
        outcomes.report(self, outcomes.IN_FLIGHT, record.key, reschedules=count + 1)
        reason = IdempotencyInFlightError(f"in_flight: {record.key} held by another worker, reschedule {count + 1}")
        self._reschedule(countdown, headers, f"in_flight: held by another worker ({count + 1})", reason)

    def _ledger_down(self, exc: LedgerError | UnsafeLedgerError, key: str, args: Any, kwargs: Any) -> Any:
        url = self.idem_settings.ledger_url
        if url not in _reported_unreachable:
            _reported_unreachable.add(url)
            what = "lost (see the CRITICAL log line)" if isinstance(exc, LedgerLostError) else "unreachable"
            log.error("idemmail: ledger %s (%s); tasks retry until it is back", what, exc)
        if self.idem_settings.fail_open:
            log.warning("idemmail: fail_open: running %s without a claim", key)
            try:
                value = self.run(*args, **kwargs)
            except BaseException as body_exc:
                outcomes.report(self, outcomes.FAIL_OPEN, key, reason=outcomes.snake(type(exc).__name__),
                                recorded="false", error=outcomes.snake(type(body_exc).__name__))
                raise
            outcomes.report(self, outcomes.FAIL_OPEN, key, message_id=_message_id(value),
                            reason=outcomes.snake(type(exc).__name__), recorded="false")
            return value
        self._retry_when_ledger_back(exc, key)

    def _retry_when_ledger_back(self, exc: LedgerError | UnsafeLedgerError, key: str) -> NoReturn:
        """Requeue this message on the outage budget (``idemmail_outage_max_retries``) until the ledger answers."""
        request, settings = self.request, self.idem_settings
        headers = dict(request.headers or {})
        count = int(headers.get(OUTAGE_HEADER) or 0)
        if settings.outage_max_retries is not None and count >= settings.outage_max_retries:
            outcomes.report(self, outcomes.LEDGER_GAVE_UP, key, reason=outcomes.snake(type(exc).__name__),
                            reschedules=count)
            raise exc
        headers[OUTAGE_HEADER] = count + 1
        countdown = backoff(count, settings.inflight_backoff, settings.inflight_backoff_max)
        outcomes.report(self, outcomes.LEDGER_UNAVAILABLE, key, reason=outcomes.snake(type(exc).__name__),
                        reschedules=count + 1)
        self._reschedule(countdown, headers, f"ledger_unavailable: {exc}", exc)

    def _reschedule(self, countdown: float, headers: dict[str, Any], why: str, reason: Exception) -> NoReturn:
        """Requeue this message like ``retry()``, without spending the task's ``max_retries``.

        ``reason`` is what monitors show for the retry (Flower: state RETRY, its repr as the exception).
        """
        request = self.request
        sig = self.signature_from_request(request, countdown=countdown, retries=request.retries, headers=headers)
        exc = Retry(why, exc=reason, when=countdown, sig=sig)
        if request.is_eager:
            sig.apply()
        else:
            sig.apply_async()
        raise exc

    def _check_reuse(self, record: Record, payload: Payload) -> None:
        builder = self.key_builder
        if not builder.must_match or record.fingerprint == builder.fingerprint(payload):
            return
        if record.payload is None or is_sealed(record.payload):
            # Erased on sent, forgotten, or sealed with keys this process lacks: the fingerprint covers them.
            fields = tuple(builder.must_match)
            outcomes.report(self, outcomes.KEY_REUSE, record.key, reason=",".join(fields))
            raise IdempotencyKeyReuseError(
                f"key {record.key} was first used with other values of {' or '.join(fields)} "
                "(its first payload is erased or sealed, so they could not be compared one by one)",
                key=record.key, fields=fields,
            )
        differ = builder.mismatched_fields(Payload.from_json(record.payload), payload)
        if differ:
            outcomes.report(self, outcomes.KEY_REUSE, record.key, reason=",".join(differ))
            raise IdempotencyKeyReuseError(
                f"key {record.key} was first used with other values of {', '.join(differ)}",
                key=record.key, fields=differ,
            )

    def _replay(self, record: Record) -> dict[str, Any]:
        """The stored outcome of a final record, as a duplicate sees it."""
        outcomes.report(self, outcomes.DUPLICATE, record.key, message_id=(record.result or {}).get("message_id"),
                        reason=(record.error or {}).get("reason"), recorded=record.state.value)
        if record.state is State.SENT:
            return self._outcome("duplicate", record.key, record.result or {}, record.updated_at)
        error = record.error or {}
        message = str(error.get("message") or error.get("reason") or record.state.value)
        reason = str(error.get("reason") or "")
        if record.state is State.REVIEW:
            raise SendNeedsReview(message, reason=reason, key=record.key)
        cls = SEND_ERRORS.get(str(error.get("type")), PermanentSendError)
        if not issubclass(cls, PermanentSendError):
            cls = PermanentSendError
        raise cls(message, reason=reason, key=record.key)

    @staticmethod
    def _outcome(status: str, key: str, stored: dict[str, Any], at: float) -> dict[str, Any]:
        return {
            "status": status,
            "key": key,
            "message_id": stored.get("message_id"),
            "sent_at": _iso(at),
            "result": stored.get("value"),
        }

    def _record(self, move: Any, key: str, token: int, info: dict[str, Any]) -> None:
        """Apply a ledger transition on an error path, and report it.

        If the ledger cannot take a final verdict (``failed``, ``review``), this message
        comes back later instead of being acknowledged: the claim, once its lease runs
        out, is then settled by the reclaim rules (resent with the key, or parked for
        review), so the intent never stays claimed with nobody left to finish it. A
        failed ``release`` needs nothing: the retry it precedes is that later delivery.
        """
        landed: dict[str, Any] = {}
        try:
            move(key, token, info)
        except LedgerError as exc:
            log.error("idemmail: could not record %s for %s: %s", move.__name__, key, exc)
            if move.__name__ in ("fail", "park") and isinstance(exc, LedgerUnavailableError):
                self._retry_when_ledger_back(exc, key)
            landed = {"recorded": "false", "error": outcomes.snake(type(exc).__name__)}
        outcomes.report(self, _MOVE_OUTCOMES.get(move.__name__, move.__name__), key, reason=info.get("reason"),
                        **landed)


#: What an error-path ledger move means for the run (see :mod:`idemmail_celery.outcomes`).
_MOVE_OUTCOMES = {"fail": outcomes.FAILED, "park": outcomes.REVIEW, "release": outcomes.RETRY}


def _older_than(headers: dict[str, Any], recovered_at: float | None) -> bool:
    """Was this message enqueued before ``recovered_at`` (an acknowledged ledger loss)?"""
    if recovered_at is None:
        return False
    try:
        return float(headers[ENQUEUED_HEADER]) < recovered_at
    except (KeyError, TypeError, ValueError):  # undated: suspect while the loss is recent
        return time.time() - recovered_at < UNDATED_AFTER_LOSS_SECONDS


def _prepare_ledgers(sender: Any = None, **_: Any) -> None:
    """On ``worker_init`` (main process, before the pool forks): open every idempotent task's ledger.

    Pool children, and children the pool starts later (``max_tasks_per_child``, a child
    killed), inherit what it read: the Redis ledger's epoch. A child that first met the
    store after it was emptied would take it for a new ledger and send again. Never raises:
    a store that is down now is checked again at the first claim.
    """
    app = getattr(sender, "app", None)
    if app is None:
        return
    seen: set[int] = set()
    for task in list(app.tasks.values()):
        if not isinstance(task, IdempotentTask):
            continue
        try:
            ledger = task.ledger
            if id(ledger) in seen:
                continue
            seen.add(id(ledger))
            ledger.prepare()
        except Exception as exc:  # the worker must start; the first claim checks again and fails closed
            log.warning("idemmail: could not open the ledger of %s at worker start (%s: %s); it is checked "
                        "again at the first claim", task.name, type(exc).__name__, exc)


# outcomes (imported above) connected its worker_init handler first: metrics are on before this opens ledgers.
worker_init.connect(_prepare_ledgers, weak=False)


def _message_id(value: Any) -> Any:
    if isinstance(value, dict):
        return value.get("message_id") or value.get("id")
    return None
