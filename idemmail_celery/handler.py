"""The idempotency handler: every decision of the state machine, and no Celery in it.

One :class:`Handler` per task (or bulk campaign) owns the guarantee. An adapter (the Celery task,
``send_campaign``, agent tools through the task) describes a delivery as a :class:`Delivery`, lends the side
effect as a :class:`SideEffect`, and carries out the :class:`Step` that comes back. :meth:`Handler.handle`
checks, claims, settles (a table by claim status: :meth:`Handler.settle`) and records; docs/guarantee.md
("The state machine") walks through every status and outcome.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar

from . import batch, recovery, rotation
from ._ahead import writing_ahead
from ._common import backoff, logsafe
from ._lease import keeper
from .chain import Carry, Verdict
from .diagnostics import heard_from, say_setup_error_once, say_unreachable_once
from .errors import (
    SEND_ERRORS,
    AmbiguousSendError,
    ConfigurationError,
    IdempotencyInFlightError,
    IdempotencyKeyError,
    IdempotencyKeyReuseError,
    InvalidEmail,
    LedgerError,
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
from .keys import IntentKeyBuilder, Payload
from .ledger import Claim, ClaimRequest, ClaimStatus, Ledger, Record, State
from .ledger.base import Mark, new_owner
from .ledger.sealed import PAYLOAD_KEY_UNKNOWN, is_sealed, park_unreadable
from .recovery import OLDER_THAN_RETENTION, RETENTION_SKEW_SECONDS, UNDATED_AFTER_LOSS_SECONDS
from .redaction import cut_leaking_chain, scrub
from .steps import (
    Action,
    Delivery,
    Outcome,
    Policy,
    SideEffect,
    Step,
    error_record,
    first_of_its_tokens,
    live_mark,
    may_have_run,
    message_id_of,
    owned_by,
    sent_outcome,
    snake,
    writes_ahead,
)

log = logging.getLogger("idemmail_celery")

#: What the handler's users import from here (the vocabulary lives in ``steps.py``, the chain in ``chain.py``).
__all__ = [
    "COMPLETE_ATTEMPTS", "INVALID_INPUT", "LEASE_MARGIN_SECONDS", "MAYBE_SENT_STAGE", "OLDER_THAN_RETENTION",
    "RETENTION_SKEW_SECONDS", "RETRY_DEADLINE", "RUN_STAGE", "UNDATED_AFTER_LOSS_SECONDS", "Action", "Delivery",
    "Handler", "Outcome", "Policy", "SideEffect", "Step", "error_record", "first_of_its_tokens", "live_mark",
    "may_have_run", "message_id_of", "owned_by", "say_setup_error_once", "say_unreachable_once", "sent_outcome",
    "snake", "wait_out", "writes_ahead"
]

#: Attempts at recording ``sent`` before the verdict travels with the next delivery instead.
COMPLETE_ATTEMPTS = 3
#: The mark stage a holder without write-ahead marks of its own writes before it runs during a rotation.
RUN_STAGE = "run"
#: How long past another holder's lease a copy waiting on it comes back at the latest (then it can take over).
LEASE_MARGIN_SECONDS = 0.5
#: The mark a release after a maybe-send leaves for the next claim (:func:`may_have_run`; a takeover keeps it).
MAYBE_SENT_STAGE = "maybe_sent"
#: The reason of an intent that ends ``failed`` because its retry deadline passed (``Delivery.retry_from``).
RETRY_DEADLINE = "retry_deadline"

#: Exceptions from ``check`` that mean the call itself is wrong: ``failed``, never retried.
INVALID_INPUT: tuple[type[BaseException], ...] = (InvalidEmail, IdempotencyKeyError, TypeError, ValueError)


def caused(error: SendError, cause: BaseException) -> SendError:
    """``error``, raised from ``cause``."""
    error.__cause__ = cause
    return error


def _published(hop: str) -> str:
    """The mark (``Ledger.mark_hop``) that says the reschedule of ``hop`` is out (see :meth:`Handler.in_flight`)."""
    return f"{hop}\0published"


class Handler:
    """The state machine for one task's intents against one :class:`Ledger`; thread-safe (nothing per call).

    ``passthrough``: exceptions a body raises to hand control back to its framework (Celery's ``Retry``): the
    claim is released, the exception re-raised, nothing recorded as sent."""

    def __init__(self, ledger: Ledger, builder: IntentKeyBuilder, policy: Policy, effect: SideEffect, *,
                 passthrough: tuple[type[BaseException], ...] = ()) -> None:
        self.ledger, self.builder, self.policy, self.effect = ledger, builder, policy, effect
        self.passthrough = passthrough

    def handle(self, d: Delivery) -> Step:
        """Check, claim, settle and record one delivery."""
        refused = self.check(d)
        if refused is not None:
            return refused
        if d.older_keys:
            try:
                d = self.recorded_key(d)
            except (LedgerUnavailableError, UnsafeLedgerError) as exc:  # nothing claimed: the next one looks again
                return self.unavailable(d, exc)
        owner = self.claimant(d)
        request = self.request(d, owner)  # arguments no JSON can hold raise here, as they always have
        try:
            claim = self.take_back(d, self.ledger.claim(request), owner)
        except Exception as exc:  # fail closed; the next delivery takes back whichever of our owners holds it
            return self.unavailable(d, exc, carry=d.held(owner))
        heard_from(self.ledger)
        return self.settle(d, claim)

    def handle_many(self, deliveries: Sequence[Delivery], *, owner: str, last: bool = False) -> list[Step]:
        """:meth:`handle` for a batch, claimed in one round trip (see :mod:`.batch`)."""
        return batch.handle_many(self, deliveries, owner=owner, last=last)

    def claimant(self, d: Delivery) -> str:
        """The owner a delivery claims under; a verdict's is the owner holding its claim (lost replies or not)."""
        if d.verdict is not None and d.resume_owners:
            return d.resume_owners[0]
        return d.owner or new_owner(d.attempt_id)

    def writes_ahead(self) -> bool:
        """Will this handler's attempts mark the ledger before their side effect (:meth:`Ledger.write_ahead`)?"""
        return writes_ahead(self.effect)

    def take_back(self, d: Delivery, claim: Claim, owner: str) -> Claim:
        """A claim busy under an older owner of this chain is taken back as that owner; one the store reclaimed
        from such an owner (it resumes the newest only) is ``resumed``. Raises like :meth:`Ledger.claim`."""
        if claim.status is ClaimStatus.RECLAIMED and owned_by(claim.previous_owner or "", d.resume_owners):
            return replace(claim, status=ClaimStatus.RESUMED)
        holder = claim.record.owner
        if claim.status is not ClaimStatus.BUSY or not owned_by(holder, d.resume_owners[1:]):
            return claim
        request = self.request(d, holder if d.verdict is not None else owner)
        return self.ledger.claim(replace(request, resume_owner=holder))

    def check(self, d: Delivery) -> Step | None:
        """None if the call may be claimed; else the step that ends it, with nothing stored."""
        if d.verdict is not None:  # decided already: nothing this worker lacks may drop it
            return None
        try:
            self.effect.check(d.payload)
        except ConfigurationError as exc:
            return self.unavailable(d, exc)
        except INVALID_INPUT as exc:
            reason = "invalid_email" if isinstance(exc, InvalidEmail) else "invalid_arguments"
            self.effect.report(Outcome.FAILED, d.key, reason=reason, recorded="false")
            error = caused(PermanentSendError(scrub(str(exc))[:500], reason=reason, key=d.key), exc)
            cut_leaking_chain(error)  # a header or tag name holding an address: the cause would print it
            return Step(Outcome.FAILED, Action.RAISE, d.key, error=error)
        except Exception as exc:  # a missing module, a broken install, a defect: nothing was sent, nothing claimed
            return self.unavailable(d, exc)
        return None

    def request(self, d: Delivery, owner: str) -> ClaimRequest:
        """The claim a delivery makes."""
        return ClaimRequest(key=d.key, task_name=d.task_name, payload=d.payload.to_json(),
                            fingerprint=self.builder.fingerprint(d.payload), owner=owner,
                            lease_seconds=self.policy.lease_seconds, writes_ahead=self.writes_ahead(),
                            resume_owner=d.resume_owners[0] if d.resume_owners else None)

    def settle(self, d: Delivery, claim: Claim) -> Step:
        """Everything after the claim, by its status (:data:`SETTLE`); bulk sends call it for each claim."""
        return self.SETTLE[claim.status](self, d, claim)

    def settle_done(self, d: Delivery, claim: Claim) -> Step:
        """A final record: replayed (a "sent" verdict of this chain's own confirms a review first)."""
        return self.check_reuse(d, claim.record) or self.confirm_verdict(d, claim.record) or self.replay(claim.record)

    def settle_busy(self, d: Delivery, claim: Claim) -> Step:
        """Another holder's claim is live: waited for (:meth:`in_flight`)."""
        return self.check_reuse(d, claim.record) or self.in_flight(d, claim.record)

    def settle_new(self, d: Delivery, claim: Claim) -> Step:
        """A key claimed for the first time (the common send): only the gates a new claim can meet (a verdict, a
        rotation, a ledger loss, the retention; never a sealed payload, a crash or a reused key), then the run."""
        step = (self.pending_verdict(d, claim) or self.cross_check(d, claim) or self.loss_gate(d, claim)
                or self.retention_gate(d, claim))
        return step or self.run(d, claim, d.payload)

    def settle_held(self, d: Delivery, claim: Claim) -> Step:
        """A claim held before (reopened, reclaimed, resumed): the first gate that answers ends it; else the side
        effect runs."""
        gates = (self.pending_verdict, self.cross_check, self.sealed_gate, self.crash_gate, self.loss_gate,
                 self.retention_gate, self.reuse_gate)
        for gate in gates:
            step = gate(d, claim)
            if step is not None:
                return step
        return self.run(d, claim, self.payload_to_run(d, claim))

    #: :meth:`settle`'s table.
    SETTLE: ClassVar[dict[ClaimStatus, Callable[[Handler, Delivery, Claim], Step]]] = {
        ClaimStatus.DONE: settle_done, ClaimStatus.BUSY: settle_busy, ClaimStatus.ACQUIRED: settle_new,
        ClaimStatus.REOPENED: settle_held, ClaimStatus.RECLAIMED: settle_held, ClaimStatus.RESUMED: settle_held,
    }

    # -- the gates a held claim passes before it runs (None: pass) --

    def pending_verdict(self, d: Delivery, claim: Claim) -> Step | None:
        """This chain decided, and could not record it: record it, never run again."""
        return None if d.verdict is None else self.record_verdict(d, claim, d.verdict)

    def recorded_key(self, d: Delivery) -> Delivery:
        """:func:`~idemmail_celery.rotation.recorded_key` (during a rotation, before the claim)."""
        return rotation.recorded_key(self, d)

    def cross_check(self, d: Delivery, claim: Claim) -> Step | None:
        """During a rotation, a claim with no sign of having run: :func:`~idemmail_celery.rotation.cross_check`."""
        return rotation.cross_check(self, d, claim) if d.other_keys and not may_have_run(claim) else None

    def sealed_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A claim held before, whose first payload this process cannot read: never run it, never strand it."""
        sealed = claim.status is not ClaimStatus.ACQUIRED and is_sealed(claim.record.payload)
        return self.unreadable(d, claim) if sealed else None

    def crash_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A claim taken over from a dead holder, or resumed with one behind it (a reclaim or a live write-ahead
        mark): :func:`~idemmail_celery.recovery.after_crash` decides."""
        crashed = claim.status is ClaimStatus.RECLAIMED or (claim.status is ClaimStatus.RESUMED and (
            claim.record.reclaims > 0 or live_mark(claim, d.resume_owners) is not None))
        return recovery.after_crash(self, d, claim) if crashed else None

    def loss_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """The loss rule (:func:`~idemmail_celery.recovery.after_loss`) for a claim nobody has decided yet: a new
        one, or one taken over or back with no mark (the first claim since the loss may have died first)."""
        undecided = claim.status is ClaimStatus.ACQUIRED or (
            claim.status in (ClaimStatus.RECLAIMED, ClaimStatus.RESUMED) and live_mark(claim, d.resume_owners) is None)
        return recovery.after_loss(self, d, claim) if undecided and recovery.older_than_loss(self, d) else None

    def retention_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A new claim for a message older than the ledger's retention (:func:`~.recovery.after_retention`)."""
        old = claim.status is ClaimStatus.ACQUIRED and recovery.older_than_retention(self, d)
        return recovery.after_retention(self, d, claim) if old else None

    def reuse_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A claim that would run its first payload, met with other must-match values: refused and released."""
        if claim.status not in (ClaimStatus.REOPENED, ClaimStatus.RESUMED):
            return None
        refused = self.check_reuse(d, claim.record)
        if refused is not None:
            self.guarded(lambda: self.ledger.release(d.key, claim.token))
        return refused

    @staticmethod
    def payload_to_run(d: Delivery, claim: Claim) -> Payload:
        """The first payload ships; if an operator erased it (``forget``), this delivery's is all there is."""
        first = claim.record.payload
        return d.payload if claim.status is ClaimStatus.ACQUIRED or not first else Payload.from_json(first)

    def run(self, d: Delivery, claim: Claim, payload: Payload) -> Step:
        """:meth:`attempt`, with the lease renewed throughout (recording and reconciling included)."""
        keeper.hold(self.ledger, d.key, claim.token, self.policy.lease_seconds)
        try:
            return self.attempt(d, claim, payload)
        finally:
            keeper.drop(self.ledger, d.key, claim.token)

    def attempt(self, d: Delivery, claim: Claim, payload: Payload) -> Step:
        """Run the side effect once and record what came of it (see :meth:`run`)."""
        key = d.key
        hook = self.ahead_hook(d, claim) if claim.record.writes_ahead else None  # as the claim's owner promised
        if hook is None and d.other_keys:  # during a rotation every run is marked: unmarked means never ran
            try:
                self.ahead_hook(d, claim)(RUN_STAGE)
            except TransientSendError as exc:
                return self.retry_or_park(d, claim, exc, exc.reason, sent_maybe=False)
        try:
            with writing_ahead(hook):
                value = self.effect.perform(payload, key)
        except self.passthrough as exc:  # the body handed control back (Celery's retry()): nothing was sent
            self.released(d, claim, {"reason": "body_retried", "at": time.time()})
            return Step(Outcome.RETRY, Action.RAISE, key, error=exc)
        except PermanentSendError as exc:
            return self.record_final(d, claim, State.FAILED, error_record(exc, exc.reason, type(exc)),
                                     exc.with_key(key))
        except SendNeedsReview as exc:
            return self.record_final(d, claim, State.REVIEW, error_record(exc, exc.reason, SendNeedsReview),
                                     exc.with_key(key))
        except TransientSendError as exc:
            return self.retry_or_park(d, claim, exc, exc.reason, sent_maybe=False)
        except Exception as exc:  # anything else: the side effect may have happened
            reason = exc.reason if isinstance(exc, AmbiguousSendError) else "unexpected_error"
            return self.retry_or_park(d, claim, exc, reason, sent_maybe=True)
        return self.record_sent(d, claim, value)

    def ahead_hook(self, d: Delivery, claim: Claim) -> Callable[[str], None]:
        """What answers :func:`~idemmail_celery.providers.base.about_to_send`: the write-ahead mark in the ledger,
        or a :class:`TransientSendError` that keeps the side effect from happening."""

        def mark(stage: str) -> None:
            try:
                held = self.ledger.write_ahead(d.key, claim.token, self.policy.lease_seconds, stage,
                                               owner=claim.record.owner)
            except LedgerError as exc:
                raise TransientSendError(f"the write-ahead mark could not be recorded ({type(exc).__name__}); "
                                         "nothing was sent", reason="ahead_unrecorded", key=d.key) from exc
            if not held:
                raise TransientSendError("the claim was lost before the send began (its lease was taken over); "
                                         "nothing was sent", reason="lease_lost", key=d.key)

        return mark

    def retry_or_park(self, d: Delivery, claim: Claim, exc: Exception, reason: str, *, sent_maybe: bool) -> Step:
        """A failed attempt: release and retry while budget and safety allow, else reconcile or park. A failure
        that sent nothing, on a dated delivery (``retry_from``), is retried until its deadline; any other retry
        is on the task's count (``max_retries``)."""
        key = d.key
        retry_safe = not sent_maybe or self.effect.carries_key()
        timed = not sent_maybe and d.retry_from is not None
        left = (d.retry_from or 0.0) + self.policy.retry_deadline_seconds - time.time()
        budget_left = left > 0 if timed else d.max_retries is None or d.retries < d.max_retries
        if retry_safe and budget_left:
            note = {**error_record(exc, reason, type(exc) if isinstance(exc, SendError) else SendError),
                    "maybe_sent": sent_maybe}
            mark = Mark(MAYBE_SENT_STAGE, time.time(), claim.token) if sent_maybe else None
            self.released(d, claim, note, mark)
            countdown = self.retry_countdown(d.retries)
            if isinstance(exc, SendError) and exc.retry_after:  # capped: see redrive.stranded_after
                countdown = max(countdown, min(exc.retry_after, self.policy.retry_backoff_max))
            carry = Carry(owners=(claim.record.owner,))
            if timed:
                countdown = min(countdown, left)  # the last attempt comes at the deadline, not after it
                if d.enqueued_at is None:  # undated (sent by name): the deadline must not move with each retry
                    carry = replace(carry, enqueued_at=d.retry_from)
            return Step(Outcome.RETRY, Action.RETRY, key, error=exc, countdown=countdown, carry=carry,
                        counted=not timed)
        if sent_maybe:
            found = self.reconciled(d, claim.record)
            if found is not None:
                return self.record_sent(d, claim, found, reconciled=True)
            why = "retries_exhausted" if retry_safe else reason
            parked = caused(SendNeedsReview(f"outcome unknown ({reason}): {scrub(str(exc))}", reason=why, key=key), exc)
            return self.record_final(d, claim, State.REVIEW, error_record(exc, why, SendNeedsReview), parked)
        if timed:
            why, gave_up = RETRY_DEADLINE, (f"gave up: the retry deadline (idemmail_retry_deadline_seconds, "
                                            f"{self.policy.retry_deadline_seconds:g} s from the first enqueue) passed "
                                            f"after {d.retries} retries")
        else:
            why, gave_up = "retries_exhausted", f"gave up after {d.retries} retries"
        failed = caused(PermanentSendError(f"{gave_up}: {scrub(str(exc))}", reason=why, key=key), exc)
        return self.record_final(d, claim, State.FAILED, error_record(exc, why, PermanentSendError), failed)

    def retry_countdown(self, retries: int) -> float:
        p = self.policy
        return backoff(retries, p.retry_backoff, p.retry_backoff_max, jitter=p.retry_jitter)

    def record_sent(self, d: Delivery, claim: Claim, value: Any, *, reconciled: bool = False) -> Step:
        """Record ``sent`` with the side effect's result; the step returns the outcome."""
        key, token = d.key, claim.token
        stored = {"value": value, "message_id": message_id_of(value)}
        unrecorded: str | None = None  # why the ledger does not hold this send, if it does not
        recorded_at: float | None = None  # as the ledger keeps it: a duplicate replays this very time
        for attempt in range(COMPLETE_ATTEMPTS + 1):
            try:
                recorded_at = self.ledger.complete(key, token, stored)
                break
            except UnserializableArgumentsError:
                # The send happened; a result JSON cannot hold must not keep it from being recorded.
                stored = {"value": None, "message_id": stored["message_id"], "unserializable": type(value).__name__}
            except StaleTokenError as exc:  # taken over while we ran: the newer record wins; said loudly
                log.error("idemmail: %s completed after losing its lease: %s", logsafe(key), logsafe(exc))
                unrecorded = "lease_lost"
                break
            except LedgerError as exc:
                if attempt < COMPLETE_ATTEMPTS and isinstance(exc, LedgerUnavailableError):
                    time.sleep(0.1 * 2 ** attempt)
                    continue
                log.error("idemmail: %s was sent but could not be recorded yet: %s", logsafe(key), logsafe(exc))
                unrecorded = "unrecorded"
                break
        outcome = sent_outcome("sent", key, stored, recorded_at or time.time())
        landed = {"reason": unrecorded, "recorded": "false"} if unrecorded else {
            "reason": "reconciled" if reconciled else None}
        self.effect.report(Outcome.SENT, key, message_id=outcome["message_id"], **landed)
        if unrecorded == "unrecorded":  # the verdict travels with the next delivery (the lease holds copies off)
            return self.unavailable(d, LedgerUnavailableError(f"{key}: sent, not yet recorded"), carry=Carry(
                owners=(claim.record.owner,), verdict=Verdict("sent", result=stored)), value=outcome)
        return Step(Outcome.SENT, Action.RETURN, key, value=outcome)

    def record_final(self, d: Delivery, claim: Claim, state: State, error: dict[str, Any],
                     exc: BaseException) -> Step:
        """Record ``failed`` or ``review`` and raise ``exc``; a ledger that cannot take it now
        gets it from the next delivery of this chain (the claim is never left to nobody)."""
        outcome = Outcome.FAILED if state is State.FAILED else Outcome.REVIEW
        move = self.ledger.fail if state is State.FAILED else self.ledger.park
        reason = str(error.get("reason") or "")
        try:
            move(d.key, claim.token, error)
        except LedgerError as exc_ledger:
            down = isinstance(exc_ledger, (LedgerUnavailableError, UnsafeLedgerError))
            log.error("idemmail: could not record %s for %s%s: %s", state.value, logsafe(d.key), " yet" if down else "",
                      logsafe(exc_ledger))
            self.effect.report(outcome, d.key, reason=reason, recorded="false", error=snake(type(exc_ledger).__name__))
            if down:
                verdict = Verdict("failed" if state is State.FAILED else "review", error=error)
                return self.unavailable(d, exc_ledger, carry=Carry(owners=(claim.record.owner,), verdict=verdict),
                                        error=exc)
            # Otherwise the claim was taken over: the newer holder's record wins.
            return self.taken_over(d) if isinstance(exc_ledger, StaleTokenError) else Step(
                outcome, Action.RAISE, d.key, error=exc)
        self.effect.report(outcome, d.key, reason=reason)
        return Step(outcome, Action.RAISE, d.key, error=exc)

    def taken_over(self, d: Delivery) -> Step:
        """The claim was taken over before ``failed`` or ``review`` was recorded: the caller is told what the
        newer holder records (a final record replayed, any other waited for like a live claim)."""
        try:
            record = self.ledger.get(d.key)
        except LedgerError as exc:  # the next delivery looks again (it holds nothing)
            return self.unavailable(d, exc)
        if record is None:  # withdrawn or forgotten meanwhile: the next delivery starts over
            return self.unavailable(d, LedgerUnavailableError(f"{d.key}: no record after a takeover"))
        return self.replay(record) if record.state.is_final else self.in_flight(d, record)

    def record_verdict(self, d: Delivery, claim: Claim, verdict: Verdict) -> Step:
        """Record what an earlier delivery of this chain decided and could not record."""
        if verdict.state == "sent":
            return self.record_sent(d, claim, (verdict.result or {}).get("value"), reconciled=False)
        error = verdict.error or {}
        reason = str(error.get("reason") or verdict.state)
        message = str(error.get("message") or reason)
        if verdict.state == "failed":
            return self.record_final(d, claim, State.FAILED, error, PermanentSendError(message, reason, d.key))
        return self.record_final(d, claim, State.REVIEW, error, SendNeedsReview(message, reason, d.key))

    def confirm_verdict(self, d: Delivery, record: Record) -> Step | None:
        """A "sent" verdict of this chain's own that meets its record parked for ``review`` (another copy found
        the lease run out while the ledger could not take the verdict): confirmed as sent, as an operator's
        ``resolve`` would. None: not that case."""
        verdict = d.verdict
        if verdict is None or verdict.state != "sent" or record.state is not State.REVIEW:
            return None
        stored = verdict.result or {}
        try:
            note = "sent by this chain; recorded from its verdict"
            confirmed = self.ledger.confirm_sent(record.key, stored, note=note, actor=d.owner or d.attempt_id,
                                                 expect=record)  # the review it met: nothing decided since
        except (LedgerUnavailableError, UnsafeLedgerError) as exc:  # the next delivery tries again
            return self.unavailable(d, exc)
        except LedgerError as exc:  # changed meanwhile (an operator's decision): the record as it is stands
            log.warning("idemmail: %s: the verdict could not be recorded over its review (%s)", logsafe(record.key),
                        type(exc).__name__)
            return None
        self.effect.report(Outcome.SENT, record.key, message_id=stored.get("message_id"), reason="verdict_confirmed")
        return Step(Outcome.SENT, Action.RETURN, record.key,
                    value=sent_outcome("sent", record.key, stored, confirmed.updated_at))

    def released(self, d: Delivery, claim: Claim, note: dict[str, Any], mark: Mark | None = None) -> None:
        """Release the claim (``mark``: the holder may have sent), reported as a retry; a failed release needs
        nothing more (the retry carries the owner and takes the claim back)."""
        self.guarded(lambda: self.ledger.release(d.key, claim.token, note, mark=mark),
                     report=lambda **landed: self.effect.report(Outcome.RETRY, d.key, reason=note.get("reason"),
                                                                **landed))

    def guarded(self, move: Callable[[], Any], report: Callable[..., None] | None = None) -> None:
        """Run a ledger move whose failure changes nothing the caller does; say what landed."""
        landed: dict[str, Any] = {}
        try:
            move()
        except LedgerError as exc:
            log.warning("idemmail: a ledger move failed (%s: %s)", type(exc).__name__, logsafe(exc))
            landed = {"recorded": "false", "error": snake(type(exc).__name__)}
        if report is not None:
            report(**landed)

    def replay(self, record: Record) -> Step:
        """A final record, as a duplicate sees it."""
        self.effect.report(Outcome.DUPLICATE, record.key, message_id=(record.result or {}).get("message_id"),
                           reason=(record.error or {}).get("reason"), recorded=record.state.value)
        if record.state is State.SENT:
            return Step(Outcome.DUPLICATE, Action.RETURN, record.key,
                        value=sent_outcome("duplicate", record.key, record.result or {}, record.updated_at))
        error = record.error or {}
        message = str(error.get("message") or error.get("reason") or record.state.value)
        cls: type[SendError] = SEND_ERRORS.get(str(error.get("type")), PermanentSendError)
        if record.state is State.REVIEW:
            cls = SendNeedsReview
        elif not issubclass(cls, PermanentSendError):
            cls = PermanentSendError
        return Step(Outcome.DUPLICATE, Action.RAISE, record.key,
                    error=cls(message, reason=str(error.get("reason") or ""), key=record.key))

    def in_flight(self, d: Delivery, record: Record) -> Step:
        """Another holder's claim is live: come back later, on a budget of this chain's own."""
        p, key = self.policy, d.key
        if d.inflight >= p.inflight_max_retries:
            self.effect.report(Outcome.IN_FLIGHT_GAVE_UP, key, reschedules=d.inflight)
            return Step(Outcome.IN_FLIGHT_GAVE_UP, Action.RAISE, key, error=IdempotencyInFlightError(
                f"{key} still held by {record.owner} after {d.inflight} reschedules"))
        # Of the copies of one message (its hop), the first to mark it publishes the reschedule and says so once
        # it is out (published()); another drops only then, and until then comes back as the same hop (the first
        # may have died before publishing): no copy is lost, none multiplies.
        confirms, same_hop = "", None
        if d.hop:
            try:
                first = self.ledger.mark_hop(key, d.hop, p.hop_ttl_seconds)
            except LedgerError:
                first = None  # cannot tell: reschedule (a countdown below the visibility timeout keeps copies few)
            if first is False and self.hop_published(key, d.hop):
                self.effect.report(Outcome.COPY_DROPPED, key, reschedules=d.inflight)
                return Step(Outcome.COPY_DROPPED, Action.DROP, key)
            same_hop, confirms = (d.hop, "") if first is False else (None, d.hop)
        countdown = backoff(d.inflight, p.inflight_backoff, p.inflight_backoff_max)
        if record.lease_expires_at:  # no use waiting past the holder's lease: then it can be taken over
            countdown = min(countdown, max(record.lease_expires_at - time.time(), 0.0) + LEASE_MARGIN_SECONDS)
        self.effect.report(Outcome.IN_FLIGHT, key, reschedules=d.inflight + 1)
        return Step(Outcome.IN_FLIGHT, Action.RESCHEDULE, key, countdown=countdown,
                    error=IdempotencyInFlightError(f"{key} held by another worker, reschedule {d.inflight + 1}"),
                    carry=Carry(inflight=d.inflight + 1, outage=d.outage, hop=same_hop), confirms_hop=confirms)

    def hop_published(self, key: str, hop: str) -> bool:
        """Has the copy that marked ``hop`` said its reschedule is out (:meth:`published`)? False: cannot say."""
        try:
            return self.ledger.hop_marked(key, _published(hop)) is True
        except LedgerError:
            return False

    def published(self, step: Step) -> None:
        """The adapter published ``step``: the one publish of its hop (``Step.confirms_hop``) says it is out, so
        the hop's other copies drop (should that fail, they come back once more each)."""
        if step.confirms_hop:
            self.guarded(lambda: self.ledger.mark_hop(step.key, _published(step.confirms_hop),
                                                  self.policy.hop_ttl_seconds))

    def unavailable(self, d: Delivery, exc: Exception, *, carry: Carry | None = None,
                    value: Any = None, error: BaseException | None = None) -> Step:
        """The ledger (or the side effect's set-up) cannot be used now: reschedule on the outage budget, with
        ``carry`` (default: what this delivery came with) for the next delivery, so the chain's claim is never
        left to nobody. When the budget runs out the step returns ``value`` or raises ``error`` (default ``exc``).
        """
        carry = d.held() if carry is None else carry
        if isinstance(exc, (LedgerUnavailableError, UnsafeLedgerError)):
            say_unreachable_once(self.ledger, exc)
            if self.policy.fail_open and carry.verdict is None:
                return self.fail_open(d, exc)
        return wait_out(self.policy, self.effect, d, exc, carry=carry, value=value, error=error)

    def fail_open(self, d: Delivery, exc: Exception) -> Step:
        """``fail_open``: run the side effect without a claim (at-least-once, by the operator's choice)."""
        log.warning("idemmail: fail_open: running %s without a claim", logsafe(d.key))
        reason = snake(type(exc).__name__)
        try:
            value = self.effect.perform(d.payload, d.key)
        except BaseException as body_exc:
            self.effect.report(Outcome.FAIL_OPEN, d.key, reason=reason, recorded="false",
                               error=snake(type(body_exc).__name__))
            raise
        self.effect.report(Outcome.FAIL_OPEN, d.key, message_id=message_id_of(value), reason=reason, recorded="false")
        return Step(Outcome.FAIL_OPEN, Action.RETURN, d.key, value=value)

    def park_unknown(self, d: Delivery, claim: Claim, reason: str, message: str, **extra: Any) -> Step:
        """Park a claim whose outcome cannot be known (``extra``: more fields for its ``error``)."""
        error = {"type": "SendNeedsReview", "reason": reason, "at": time.time(), "message": message, **extra}
        return self.record_final(d, claim, State.REVIEW, error, SendNeedsReview(message, reason=reason, key=d.key))

    def unreadable(self, d: Delivery, claim: Claim) -> Step:
        """A held claim whose first payload is sealed, in a process without payload keys: parked for review
        (``payload_key_unknown``); if parking fails, waited for as in flight."""
        after = park_unreadable(self.ledger, claim)
        if after.status is ClaimStatus.BUSY:
            return self.in_flight(d, after.record)
        self.effect.report(Outcome.REVIEW, d.key, reason=PAYLOAD_KEY_UNKNOWN)
        return Step(Outcome.REVIEW, Action.RAISE, d.key, error=PayloadKeyError(
            f"ledger record {d.key} is sealed but this process has no idemmail_payload_keys (parked for review); "
            "configure the same payload keys as the other workers, then resolve it"))

    def reconciled(self, d: Delivery, record: Record) -> Any | None:
        """The side effect's service says it happened (its result), or None; asking is best effort."""
        try:
            return self.effect.reconcile(d.key, Payload.from_json(record.payload) if record.payload else d.payload)
        except Exception as exc:  # review is the safe answer
            log.warning("idemmail: reconciling %s failed: %s", logsafe(d.key), type(exc).__name__)
            return None

    def check_reuse(self, d: Delivery, record: Record) -> Step | None:
        """A key reused with other must-match values is refused (None: it is not)."""
        builder = self.builder
        if not builder.must_match or builder.fingerprint_matches(record.fingerprint, d.payload):
            return None
        if record.payload is None or is_sealed(record.payload):  # erased or sealed: the fingerprint covers them
            fields = tuple(builder.must_match)
            detail = "(its first payload is erased or sealed, so they could not be compared one by one)"
            message = f"key {record.key} was first used with other values of {' or '.join(fields)} {detail}"
        else:
            fields = builder.mismatched_fields(Payload.from_json(record.payload), d.payload)
            if not fields:
                return None
            message = f"key {record.key} was first used with other values of {', '.join(fields)}"
        self.effect.report(Outcome.KEY_REUSE, record.key, reason=",".join(fields))
        return Step(Outcome.KEY_REUSE, Action.RAISE, record.key,
                    error=IdempotencyKeyReuseError(message, key=record.key, fields=fields))


def wait_out(policy: Policy, effect: SideEffect, d: Delivery, exc: BaseException, *,
             carry: Carry | None = None, value: Any = None, error: BaseException | None = None) -> Step:
    """Reschedule ``d`` on the outage budget (:meth:`Handler.unavailable`; adapters call this when even the
    handler cannot be built): ``ledger_unavailable``, or ``setup_error`` for anything but a ledger error (its
    fix logged at ERROR once per process)."""
    key, word = d.key, snake(type(exc).__name__)
    carry = d.held() if carry is None else carry
    ledger_down = isinstance(exc, LedgerError)
    if not ledger_down:
        say_setup_error_once(exc)
    if policy.outage_max_retries is not None and d.outage >= policy.outage_max_retries:
        effect.report(Outcome.LEDGER_GAVE_UP, key, reason=word, reschedules=d.outage)
        if value is not None:
            return Step(Outcome.SENT, Action.RETURN, key, value=value)
        return Step(Outcome.LEDGER_GAVE_UP, Action.RAISE, key, error=error or exc)
    countdown = backoff(d.outage, policy.inflight_backoff, policy.inflight_backoff_max)
    if carry.verdict is not None:  # back before the claim's lease can run out: no copy may take it
        countdown = min(countdown, policy.lease_seconds / 3)
    outcome = Outcome.LEDGER_UNAVAILABLE if ledger_down else Outcome.SETUP_ERROR
    effect.report(outcome, key, reason=word, reschedules=d.outage + 1)
    return Step(outcome, Action.RESCHEDULE, key, countdown=countdown, error=exc,
                carry=replace(carry, inflight=d.inflight, outage=d.outage + 1))


