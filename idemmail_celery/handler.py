"""The idempotency handler: every decision of the state machine, and no Celery in it.

One :class:`Handler` per task (or per bulk campaign) owns the guarantee. An adapter (the
Celery task, ``send_campaign``, agent tools through the task) describes a delivery as a
:class:`Delivery`, lends the side effect through :class:`SideEffect`, and carries out the
:class:`Step` that comes back: return a value, raise an error, retry, reschedule, or drop
a redundant copy. Read top to bottom, :meth:`Handler.handle` is the guarantee:

1. **check** the call before anything is stored: bad input ends ``failed`` (never stored,
   never retried); a side effect that cannot be set up (a provider without its API key)
   waits on the outage budget like an unavailable ledger.
2. **claim** the key (taking back this chain's own earlier claim, see ``Delivery.resume_owners``).
   An unavailable ledger fails closed: rescheduled on the outage budget, nothing sent
   (or run without a claim when ``fail_open`` says so).
3. **settle** by what the ledger says:

   ============================  ==========================================================
   claim status                  what happens
   ============================  ==========================================================
   ``acquired``                  run the body (after an acknowledged ledger loss, a message
                                 enqueued before it is reconciled or parked unless the key
                                 travels downstream; a message enqueued longer ago than the
                                 retention is reconciled or parked; during a key-secret rotation,
                                 only once the intent's other keys are read again and found
                                 empty: else the claim is withdrawn and rescheduled, see
                                 ``cross_check``)
   ``reopened``/``resumed``      run the *stored first payload* (``resumed`` with a verdict
                                 this chain could not record: record it, run nothing)
   ``done``                      replay: return the stored result, or raise the stored error
   ``busy``                      another holder is live: reschedule (own budget); a second
                                 copy of the same reschedule drops once the first has
                                 published it, and comes back as the same hop until then
   ``reclaimed``                 the holder died: run again with the same key if it travels
                                 downstream; else reconcile, or park as ``review`` (during a
                                 rotation, unless it may have run, first checked as a new
                                 claim: ``cross_check``)
   ============================  ==========================================================

4. **record** what the body did: a result is ``sent``; :class:`TransientSendError`
   releases and retries (for ``Policy.retry_deadline_seconds`` from the first enqueue when the
   adapter dates the delivery, ``Delivery.retry_from``; else within ``max_retries``);
   :class:`PermanentSendError` is ``failed``; :class:`SendNeedsReview`,
   :class:`AmbiguousSendError` and any unexpected exception mean "maybe sent": retried
   with the same key when it travels downstream, reconciled or parked as ``review``
   otherwise. A verdict the ledger cannot take right now travels with the next delivery
   (``Step.carry``), which records it: an intent is never left claimed by nobody.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

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
    "COMPLETE_ATTEMPTS",
    "INVALID_INPUT",
    "LEASE_MARGIN_SECONDS",
    "MAYBE_SENT_STAGE",
    "OLDER_THAN_RETENTION",
    "RETENTION_SKEW_SECONDS",
    "RETRY_DEADLINE",
    "RUN_STAGE",
    "UNDATED_AFTER_LOSS_SECONDS",
    "Action",
    "Delivery",
    "Handler",
    "Outcome",
    "Policy",
    "SideEffect",
    "Step",
    "error_record",
    "first_of_its_tokens",
    "live_mark",
    "may_have_run",
    "message_id_of",
    "owned_by",
    "say_setup_error_once",
    "say_unreachable_once",
    "sent_outcome",
    "snake",
    "wait_out",
    "writes_ahead",
]

#: Attempts at recording ``sent`` before the verdict travels with the next delivery instead.
COMPLETE_ATTEMPTS = 3
#: The stage of the mark a holder whose side effect makes no mark of its own writes before running it during a
#: key-secret rotation (see :meth:`Handler.attempt`).
RUN_STAGE = "run"
#: How long past another holder's lease a copy waiting on it comes back at the latest: its lease then has
#: run out, and the copy takes the claim over (the holder died) or finds it settled.
LEASE_MARGIN_SECONDS = 0.5
#: The stage of the release note of an attempt that may have sent, to be retried with its key: the claim that
#: reopens the record carries it as a mark (its side effect may have run under this key: see
#: :func:`may_have_run`), and a takeover keeps it rather than write the ``unknown`` mark over it.
MAYBE_SENT_STAGE = "maybe_sent"
#: The reason of an intent that ends ``failed`` because its retry deadline passed while every attempt
#: failed without sending (``Delivery.retry_from``).
RETRY_DEADLINE = "retry_deadline"


#: Exceptions from ``check`` that mean the call itself is wrong: ``failed``, never retried.
INVALID_INPUT: tuple[type[BaseException], ...] = (InvalidEmail, IdempotencyKeyError, TypeError, ValueError)


def _published(hop: str) -> str:
    """The mark (``Ledger.mark_hop``) that says the reschedule of ``hop`` is out (see :meth:`Handler.in_flight`)."""
    return f"{hop}\0published"


class Handler:
    """The state machine for one task's intents against one :class:`Ledger`.

    Thread-safe: it keeps nothing per call. ``passthrough`` names exceptions a body raises
    to hand control back to its framework (Celery's ``Retry``): the claim is released, the
    exception re-raised, and nothing recorded as sent.
    """

    def __init__(self, ledger: Ledger, builder: IntentKeyBuilder, policy: Policy, effect: SideEffect, *,
                 passthrough: tuple[type[BaseException], ...] = ()) -> None:
        self.ledger, self.builder, self.policy, self.effect = ledger, builder, policy, effect
        self.passthrough = passthrough

    # -- the whole path --

    def handle(self, d: Delivery) -> Step:
        """Check, claim, settle and record one delivery."""
        refused = self.check(d)
        if refused is not None:
            return refused
        if d.older_keys:
            try:
                d = self.recorded_key(d)
            except (LedgerUnavailableError, UnsafeLedgerError) as exc:
                # Nothing claimed yet: the next delivery looks again, holding what this one held.
                return self.unavailable(d, exc)
        owner = self.claimant(d)
        request = self.request(d, owner)  # arguments no JSON can hold raise here, as they always have
        try:
            claim = self.take_back(d, self.ledger.claim(request), owner)
        except Exception as exc:
            # Fail closed. The claim may have landed with its reply lost, or not: the next delivery
            # takes back whichever of this chain's owners holds it.
            return self.unavailable(d, exc, carry=d.held(owner))
        heard_from(self.ledger)
        return self.settle(d, claim)

    def handle_many(self, deliveries: Sequence[Delivery], *, owner: str, last: bool = False) -> list[Step]:
        """:meth:`handle` for a batch: claimed in one round trip, then settled one by one; a step per delivery, in
        order. A failure of the batch's claim is raised, not made a step per delivery (see :mod:`.batch`)."""
        return batch.handle_many(self, deliveries, owner=owner, last=last)

    def claimant(self, d: Delivery) -> str:
        """The owner a delivery claims under. A verdict is claimed as the owner holding its claim, so
        that the claim stays that owner's whether or not this one lands (its reply may be lost): it is
        recorded, never run, whoever takes it."""
        if d.verdict is not None and d.resume_owners:
            return d.resume_owners[0]
        return d.owner or new_owner(d.attempt_id)

    def writes_ahead(self) -> bool:
        """Will this handler's attempts mark the ledger before their side effect (:meth:`Ledger.write_ahead`)?"""
        return writes_ahead(self.effect)

    def take_back(self, d: Delivery, claim: Claim, owner: str) -> Claim:
        """A claim found busy under an older owner of this chain (an earlier claim of it landed, a later
        one did not) is taken back as that owner: never left to wait out its lease as someone else's; one
        the store reclaimed from such an owner is this chain's own too (``resumed``).

        Raises :class:`LedgerUnavailableError` like :meth:`Ledger.claim`.
        """
        if claim.status is ClaimStatus.RECLAIMED and owned_by(claim.previous_owner or "", d.resume_owners):
            # An older owner's claim whose lease ran out: the store took it over rather than resume it (it
            # resumes the newest owner only), but it was this chain's, whose delivery ended with a step.
            return replace(claim, status=ClaimStatus.RESUMED)
        holder = claim.record.owner
        if claim.status is not ClaimStatus.BUSY or not owned_by(holder, d.resume_owners[1:]):
            return claim
        request = self.request(d, holder if d.verdict is not None else owner)
        return self.ledger.claim(replace(request, resume_owner=holder))

    def check(self, d: Delivery) -> Step | None:
        """None if the call may be claimed; else the step that ends it, with nothing stored."""
        if d.verdict is not None:
            # Sent (or decided) already, to be recorded and never run: a provider this worker cannot
            # build, or a rule the payload no longer meets, must not drop the verdict.
            return None
        try:
            self.effect.check(d.payload)
        except ConfigurationError as exc:
            return self.unavailable(d, exc)
        except INVALID_INPUT as exc:
            reason = "invalid_email" if isinstance(exc, InvalidEmail) else "invalid_arguments"
            self.effect.report(Outcome.FAILED, d.key, reason=reason, recorded="false")
            error = PermanentSendError(scrub(str(exc))[:500], reason=reason, key=d.key)
            error.__cause__ = exc
            cut_leaking_chain(error)  # a header or tag name holding an address: the cause would print it
            return Step(Outcome.FAILED, Action.RAISE, d.key, error=error)
        except Exception as exc:  # a missing module, a broken install, a defect: nothing was sent, nothing claimed
            return self.unavailable(d, exc)
        return None


    def request(self, d: Delivery, owner: str) -> ClaimRequest:
        """The claim a delivery makes."""
        payload = d.payload
        return ClaimRequest(key=d.key, task_name=d.task_name, payload=payload.to_json(),
                            fingerprint=self.builder.fingerprint(payload), owner=owner,
                            lease_seconds=self.policy.lease_seconds, writes_ahead=self.writes_ahead(),
                            resume_owner=d.resume_owners[0] if d.resume_owners else None)

    def settle(self, d: Delivery, claim: Claim) -> Step:
        """Everything after the claim (bulk sends call this for each claim of a batch).

        A final record is replayed and a live holder's claim waited for. A claim this delivery holds meets
        the gates below in order; the first that answers ends the delivery, and if none does the side
        effect runs (:meth:`run`) with the payload :meth:`payload_to_run` names.
        """
        if claim.status is ClaimStatus.DONE:
            record = claim.record
            return self.check_reuse(d, record) or self.confirm_verdict(d, record) or self.replay(record)
        if claim.status is ClaimStatus.BUSY:
            return self.check_reuse(d, claim.record) or self.in_flight(d, claim.record)
        gates = (self.pending_verdict, self.rotation_gate, self.sealed_gate, self.crash_gate, self.loss_gate,
                 self.retention_gate, self.reuse_gate)
        for gate in gates:
            step = gate(d, claim)
            if step is not None:
                return step
        return self.run(d, claim, self.payload_to_run(d, claim))

    # -- the gates a held claim passes before it runs (None: pass) --

    def pending_verdict(self, d: Delivery, claim: Claim) -> Step | None:
        """This chain decided, and could not record it: record it, never run again."""
        return None if d.verdict is None else self.record_verdict(d, claim, d.verdict)

    def rotation_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A key-secret rotation: another key's claim may have come meanwhile (:meth:`cross_check`)."""
        return self.cross_check(d, claim) if d.other_keys and not may_have_run(claim) else None

    def recorded_key(self, d: Delivery) -> Delivery:
        """During a rotation, before the claim: the delivery under the key its intent is recorded with
        (:func:`~idemmail_celery.rotation.recorded_key`)."""
        return rotation.recorded_key(self, d)

    def cross_check(self, d: Delivery, claim: Claim) -> Step | None:
        """During a rotation, after a new claim: None if no other key of the intent has a record
        (:func:`~idemmail_celery.rotation.cross_check`)."""
        return rotation.cross_check(self, d, claim)

    def sealed_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A claim held before, whose first payload this process cannot read: never run it, never strand it."""
        if claim.status is not ClaimStatus.ACQUIRED and is_sealed(claim.record.payload):
            return self.unreadable(d, claim)
        return None

    def crash_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A claim taken over from a dead holder; or a resumed one with a dead holder behind it (this chain's
        own reclaim whose reply was lost) or a write-ahead mark (an earlier delivery of this chain that began
        its side effect and died): :func:`~idemmail_celery.recovery.after_crash` decides."""
        resumed_after_a_crash = claim.status is ClaimStatus.RESUMED and (
            claim.record.reclaims > 0 or live_mark(claim, d.resume_owners) is not None)
        if claim.status is ClaimStatus.RECLAIMED or resumed_after_a_crash:
            return recovery.after_crash(self, d, claim)
        return None

    def loss_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """The loss rule (:func:`~idemmail_celery.recovery.after_loss`): a new claim, and one taken over or
        back with no mark (the first claim since the loss may have lost its reply, or died, before its holder
        applied the rule: nobody has decided yet)."""
        undecided = claim.status is ClaimStatus.ACQUIRED or (
            claim.status in (ClaimStatus.RECLAIMED, ClaimStatus.RESUMED) and live_mark(claim, d.resume_owners) is None)
        return recovery.after_loss(self, d, claim) if undecided and recovery.older_than_loss(self, d) else None

    def retention_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A new claim for a message older than what the ledger can vouch for
        (:func:`~idemmail_celery.recovery.after_retention`)."""
        if claim.status is ClaimStatus.ACQUIRED and recovery.older_than_retention(self, d):
            return recovery.after_retention(self, d, claim)
        return None

    def reuse_gate(self, d: Delivery, claim: Claim) -> Step | None:
        """A claim that runs its first payload, met with other must-match values: refused, and released (nothing
        ran: the first payload's own retry will)."""
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

    # -- running the side effect --

    def run(self, d: Delivery, claim: Claim, payload: Payload) -> Step:
        """Run the side effect under the claim and record what came of it; the lease is renewed
        throughout, recording and reconciling included (they may wait on a slow store or provider)."""
        keeper.hold(self.ledger, d.key, claim.token, self.policy.lease_seconds)
        try:
            return self.attempt(d, claim, payload)
        finally:
            keeper.drop(self.ledger, d.key, claim.token)

    def attempt(self, d: Delivery, claim: Claim, payload: Payload) -> Step:
        """Run the side effect once and record what came of it (see :meth:`run`)."""
        key = d.key
        # Marked whenever the claim's owner promised it: decided once, when the owner was made (claimant()).
        hook = self.ahead_hook(d, claim) if claim.record.writes_ahead else None
        if hook is None and d.other_keys:
            # During a key-secret rotation a claim that may run is marked even if its side effect makes no mark
            # of its own (it carries a key): a claim without one never ran (cross_check, may_have_run).
            try:
                self.ahead_hook(d, claim)(RUN_STAGE)
            except TransientSendError as exc:
                return self.retry_or_park(d, claim, exc, exc.reason, sent_maybe=False)
        try:
            with writing_ahead(hook):
                value = self.effect.perform(payload, key)
        except self.passthrough as exc:
            # The body handed control back (Celery's retry()): by that contract nothing was sent.
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
        """What answers the side effect's :func:`~idemmail_celery.providers.base.about_to_send`: the
        write-ahead mark in the ledger, or a :class:`TransientSendError` that keeps it from sending."""
        lease = self.policy.lease_seconds

        def mark(stage: str) -> None:
            try:
                held = self.ledger.write_ahead(d.key, claim.token, lease, stage, owner=claim.record.owner)
            except LedgerError as exc:
                raise TransientSendError(f"the write-ahead mark could not be recorded ({type(exc).__name__}); "
                                         "nothing was sent", reason="ahead_unrecorded", key=d.key) from exc
            if not held:
                raise TransientSendError("the claim was lost before the send began (its lease was taken over); "
                                         "nothing was sent", reason="lease_lost", key=d.key)

        return mark

    def retry_or_park(self, d: Delivery, claim: Claim, exc: Exception, reason: str, *, sent_maybe: bool) -> Step:
        """A failed attempt: release and retry while budget and safety allow, else reconcile or park.

        A failure that sent nothing, on a dated delivery (``retry_from``), is retried until its deadline (an
        outage of minutes costs no email); any other retry is on the task's count (``max_retries``).
        """
        key = d.key
        retry_safe = not sent_maybe or self.effect.carries_key()
        timed = not sent_maybe and d.retry_from is not None
        left = (d.retry_from or 0.0) + self.policy.retry_deadline_seconds - time.time()
        budget_left = left > 0 if timed else d.max_retries is None or d.retries < d.max_retries
        if retry_safe and budget_left:
            note = {**error_record(exc, reason, type(exc) if isinstance(exc, SendError) else SendError),
                    "maybe_sent": sent_maybe}
            # Retried with its key after a maybe-send: the release leaves a write-ahead mark for whoever claims it next.
            mark = Mark(MAYBE_SENT_STAGE, time.time(), claim.token) if sent_maybe else None
            self.released(d, claim, note, mark)
            countdown = self.retry_countdown(d.retries)
            if isinstance(exc, SendError) and exc.retry_after:
                # Honoured up to the backoff's maximum (one asking for longer is asked again then): a claim whose
                # release did not land stays claimed, unrenewed, for the wait, and the re-drive sweep takes no
                # claim for stranded before twice that maximum (redrive.stranded_after).
                countdown = max(countdown, min(exc.retry_after, self.policy.retry_backoff_max))
            # If the release did not land, the retry takes its own claim back instead of waiting on it.
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
            parked = SendNeedsReview(f"outcome unknown ({reason}): {scrub(str(exc))}", reason=why, key=key)
            parked.__cause__ = exc
            return self.record_final(d, claim, State.REVIEW, error_record(exc, why, SendNeedsReview), parked)
        if timed:
            why, gave_up = RETRY_DEADLINE, (f"gave up: the retry deadline (idemmail_retry_deadline_seconds, "
                                            f"{self.policy.retry_deadline_seconds:g} s from the first enqueue) passed "
                                            f"after {d.retries} retries")
        else:
            why, gave_up = "retries_exhausted", f"gave up after {d.retries} retries"
        failed = PermanentSendError(f"{gave_up}: {scrub(str(exc))}", reason=why, key=key)
        failed.__cause__ = exc
        return self.record_final(d, claim, State.FAILED, error_record(exc, why, PermanentSendError), failed)

    def retry_countdown(self, retries: int) -> float:
        p = self.policy
        return backoff(retries, p.retry_backoff, p.retry_backoff_max, jitter=p.retry_jitter)

    # -- recording --

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
            except StaleTokenError as exc:
                # Our lease was taken over while we ran; the newer holder's record wins. If it also
                # sent (no key downstream), the intent went out twice: said loudly.
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
        if unrecorded == "unrecorded":
            # The verdict travels with the next delivery, which takes this claim back and records it;
            # meanwhile the lease keeps any copy from sending again.
            self.effect.report(Outcome.SENT, key, message_id=outcome["message_id"], reason=unrecorded,
                               recorded="false")
            return self.unavailable(d, LedgerUnavailableError(f"{key}: sent, not yet recorded"), carry=Carry(
                owners=(claim.record.owner,), verdict=Verdict("sent", result=stored)),
                value=outcome)
        if unrecorded:
            self.effect.report(Outcome.SENT, key, message_id=outcome["message_id"], reason=unrecorded,
                               recorded="false")
        else:
            self.effect.report(Outcome.SENT, key, message_id=outcome["message_id"],
                               reason="reconciled" if reconciled else None)
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
        except (LedgerUnavailableError, UnsafeLedgerError) as exc_ledger:
            log.error("idemmail: could not record %s for %s yet: %s", state.value, logsafe(d.key), logsafe(exc_ledger))
            self.effect.report(outcome, d.key, reason=reason, recorded="false", error=snake(type(exc_ledger).__name__))
            return self.unavailable(d, exc_ledger, carry=Carry(
                owners=(claim.record.owner,), verdict=Verdict("failed" if state is State.FAILED else "review",
                                                              error=error)),
                error=exc)
        except LedgerError as exc_ledger:  # the claim was taken over: the newer holder's record wins
            log.error("idemmail: could not record %s for %s: %s", state.value, logsafe(d.key), logsafe(exc_ledger))
            self.effect.report(outcome, d.key, reason=reason, recorded="false", error=snake(type(exc_ledger).__name__))
            if isinstance(exc_ledger, StaleTokenError):
                return self.taken_over(d)
            return Step(outcome, Action.RAISE, d.key, error=exc)
        self.effect.report(outcome, d.key, reason=reason)
        return Step(outcome, Action.RAISE, d.key, error=exc)

    def taken_over(self, d: Delivery) -> Step:
        """This delivery's claim was taken over before it could record ``failed`` or ``review``: the intent's
        outcome is what the newer holder records (it may send, after this attempt sent nothing or is parked by
        the newer one's own rules), and that is what the caller is told: a final record is replayed, any other
        waited for as a copy waits for a live claim."""
        try:
            record = self.ledger.get(d.key)
        except LedgerError as exc:  # the next delivery looks again (it holds nothing)
            return self.unavailable(d, exc)
        if record is None:  # withdrawn or forgotten meanwhile: the next delivery starts over
            return self.unavailable(d, LedgerUnavailableError(f"{d.key}: no record after a takeover"))
        if record.state.is_final:
            return self.replay(record)
        return self.in_flight(d, record)

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
        """A "sent" verdict of this chain's own that meets its record parked for ``review``: recorded as sent.

        Another copy of the chain (a message the broker handed out again, its pass state older than the
        verdict) found the claim's lease run out while the ledger could not take the verdict, and parked
        it as "may have been sent". The verdict says it was: the record is confirmed (as an operator's
        ``resolve`` would be), never sent again, never left for someone to look into. None: not that case.
        """
        verdict = d.verdict
        if verdict is None or verdict.state != "sent" or record.state is not State.REVIEW:
            return None
        stored = verdict.result or {}
        try:
            confirmed = self.ledger.confirm_sent(record.key, stored, note="sent by this chain; recorded from its "
                                                                          "verdict", actor=d.owner or d.attempt_id,
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
        """Release the claim (the next claim runs it; ``mark``, if the holder may have sent); reported as a retry.
        A release that fails needs nothing more: the retry it precedes carries the owner and takes the claim back."""
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

    # -- what the other statuses lead to --

    def replay(self, record: Record) -> Step:
        """A final record, as a duplicate sees it."""
        self.effect.report(Outcome.DUPLICATE, record.key, message_id=(record.result or {}).get("message_id"),
                           reason=(record.error or {}).get("reason"), recorded=record.state.value)
        if record.state is State.SENT:
            return Step(Outcome.DUPLICATE, Action.RETURN, record.key,
                        value=sent_outcome("duplicate", record.key, record.result or {}, record.updated_at))
        error = record.error or {}
        message = str(error.get("message") or error.get("reason") or record.state.value)
        reason = str(error.get("reason") or "")
        exc: SendError
        if record.state is State.REVIEW:
            exc = SendNeedsReview(message, reason=reason, key=record.key)
        else:
            cls = SEND_ERRORS.get(str(error.get("type")), PermanentSendError)
            if not issubclass(cls, PermanentSendError):
                cls = PermanentSendError
            exc = cls(message, reason=reason, key=record.key)
        return Step(Outcome.DUPLICATE, Action.RAISE, record.key, error=exc)

    def in_flight(self, d: Delivery, record: Record) -> Step:
        """Another holder's claim is live: come back later, on a budget of this chain's own."""
        p, key = self.policy, d.key
        if d.inflight >= p.inflight_max_retries:
            self.effect.report(Outcome.IN_FLIGHT_GAVE_UP, key, reschedules=d.inflight)
            return Step(Outcome.IN_FLIGHT_GAVE_UP, Action.RAISE, key, error=IdempotencyInFlightError(
                f"{key} still held by {record.owner} after {d.inflight} reschedules"))
        # Of the copies of one message (its hop), one publishes the reschedule: the one whose mark_hop is first.
        # It says so once the reschedule is out (published()); a copy that finds the hop marked drops only
        # then. Until then it comes back as the same hop, never as a new one: the copy that marked may have died
        # before publishing (a mark set before a publish that never happened), and then this copy is the only
        # message carrying the intent; and copies that keep their hop never multiply.
        confirms, same_hop = "", None
        if d.hop:
            try:
                first = self.ledger.mark_hop(key, d.hop, p.hop_ttl_seconds)
            except LedgerError:
                first = None  # cannot tell: reschedule (a countdown below the visibility timeout keeps copies few)
            if first is False and self.hop_published(key, d.hop):
                self.effect.report(Outcome.COPY_DROPPED, key, reschedules=d.inflight)
                return Step(Outcome.COPY_DROPPED, Action.DROP, key)
            if first is False:
                same_hop = d.hop
            else:
                confirms = d.hop
        countdown = backoff(d.inflight, p.inflight_backoff, p.inflight_backoff_max)
        if record.lease_expires_at:  # no use waiting past the holder's lease: then it can be taken over
            countdown = min(countdown, max(record.lease_expires_at - time.time(), 0.0) + LEASE_MARGIN_SECONDS)
        self.effect.report(Outcome.IN_FLIGHT, key, reschedules=d.inflight + 1)
        return Step(Outcome.IN_FLIGHT, Action.RESCHEDULE, key, countdown=countdown,
                    error=IdempotencyInFlightError(f"{key} held by another worker, "
                                                   f"reschedule {d.inflight + 1}"),
                    carry=Carry(inflight=d.inflight + 1, outage=d.outage, hop=same_hop),
                    confirms_hop=confirms)

    def hop_published(self, key: str, hop: str) -> bool:
        """Has the copy of ``hop`` that marked it said its reschedule is out (:meth:`published`)? False when
        the ledger cannot say: the copy asking comes back and asks again."""
        try:
            return self.ledger.hop_marked(key, _published(hop)) is True
        except LedgerError:
            return False

    def published(self, step: Step) -> None:
        """The adapter published ``step``: a reschedule that is its hop's one publish (``Step.confirms_hop``)
        says it is out, so that the hop's other copies drop. Should that fail, they come back once more each
        and look again (no copy is lost, none multiplies)."""
        if not step.confirms_hop:
            return
        self.guarded(lambda: self.ledger.mark_hop(step.key, _published(step.confirms_hop),
                                                  self.policy.hop_ttl_seconds))

    def unavailable(self, d: Delivery, exc: Exception, *, carry: Carry | None = None,
                    value: Any = None, error: BaseException | None = None) -> Step:
        """The ledger (or the side effect's set-up) cannot be used now: reschedule on the outage budget.

        ``carry`` travels with the next delivery (an owner to take back, a verdict to record); without
        it, what this delivery came with does (the owners that may hold its claim, its verdict): nothing
        that ends a delivery before its outcome is recorded leaves the chain's claim to nobody.
        When the budget runs out the step returns ``value`` or raises ``error`` (default ``exc``).
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
        """A held claim whose first payload is sealed, in a process without payload keys: parked
        for review (``payload_key_unknown``); if parking fails, rescheduled as in flight, so a
        later delivery meets the record again once the claim's lease runs out."""
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
        if record.payload is None or is_sealed(record.payload):
            # Erased on sent, forgotten, or sealed with keys this process lacks: the fingerprint covers them.
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
    """Reschedule ``d`` on the outage budget (see :meth:`Handler.unavailable`), with ``carry`` for its next
    delivery. A ledger that cannot answer is ``ledger_unavailable``; anything else (a set-up error: a missing
    API key or driver, a broken install, a defect before the claim) is ``setup_error``, and its fix is
    logged at ERROR once per process. Adapters call this when even the handler cannot be built."""
    key = d.key
    carry = d.held() if carry is None else carry
    word = snake(type(exc).__name__)
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


