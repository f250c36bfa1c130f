"""Key-secret rotation: how a claim stays the intent's only one while its key has two forms.

During a rotation a call has a key under the new secret and one under each older secret still
listed, and workers of both phases of a rolling restart claim under either. Before the claim,
:func:`recorded_key` finds the key the intent is already recorded under; between a new claim and
anything it runs, :func:`cross_check` reads the other keys again (the look-up and the claim are
not atomic). The handler calls these two; the rest are their steps. Without a rotation nothing
here runs (``Delivery.older_keys`` and ``other_keys`` are empty).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ._common import logsafe
from .errors import LedgerError, LedgerUnavailableError, PayloadKeyError, UnsafeLedgerError
from .ledger import Claim, Record, State
from .ledger.base import new_owner
from .steps import Delivery, Settling, Step, first_of_its_tokens, owned_by

log = logging.getLogger("idemmail_celery")


def recorded_key(h: Settling, d: Delivery) -> Delivery:
    """During a rotation: the delivery under the older key its intent is recorded with, if any
    (one read per older secret, only while rotating).

    Raises :class:`LedgerUnavailableError` (or :class:`UnsafeLedgerError`) when a read fails:
    claiming under the new key could then send an intent recorded under an old one (the keys
    live in other buckets, on a cluster on other nodes, and a blip may pass before the claim).
    """
    keys = (d.key, *d.older_keys)
    for old in d.older_keys:
        try:
            found = h.ledger.get(old) is not None
        except PayloadKeyError:  # sealed with a key this process lacks: the record is there all the same
            found = True
        except (LedgerUnavailableError, UnsafeLedgerError):
            raise
        except LedgerError as exc:  # anything else the store said: not an answer either way
            raise LedgerUnavailableError(f"rotation lookup of {old} failed: {exc}") from exc
        if found:
            if d.resume_owners and d.verdict is None:
                drop_unchecked(h, d)
            return replace(d, key=old, older_keys=(), other_keys=tuple(k for k in keys if k != old))
    return replace(d, other_keys=d.older_keys)


def drop_unchecked(h: Settling, d: Delivery) -> None:
    """The intent is recorded under another key, and this chain may hold a claim under ``d.key`` that
    never ran (an earlier delivery's :func:`cross_check` could not read, nor withdraw; or its claim's
    reply was lost): withdrawn, so that nobody takes it over once its lease runs out and sends the
    intent again. A claim with any sign of having run (a reclaim, a write-ahead mark) is left alone.

    Raises :class:`LedgerUnavailableError` (or :class:`UnsafeLedgerError`) like :func:`recorded_key`.
    """
    try:
        record = h.ledger.get(d.key)
        if (record is not None and record.state is State.CLAIMED and record.reclaims == 0
                and record.mark is None and owned_by(record.owner, d.resume_owners)):
            h.ledger.withdraw(d.key, record.token)
    except PayloadKeyError:  # sealed with a key this process lacks: not this chain's claim to judge
        return
    except (LedgerUnavailableError, UnsafeLedgerError):
        raise
    except LedgerError as exc:
        raise LedgerUnavailableError(f"rotation clean-up of {d.key} failed: {exc}") from exc
    except NotImplementedError:  # a ledger without withdraw: its lease runs out, the reclaim rules decide
        log.warning("idemmail: %s: %s cannot withdraw a claim; it is left to its lease", logsafe(d.key),
                    type(h.ledger.backend).__name__)


def cross_check(h: Settling, d: Delivery, claim: Claim) -> Step | None:
    """During a key-secret rotation, between a new claim and anything it runs: read the intent's other
    keys (``Delivery.other_keys``) again. None: none has a record, the claim may run.

    The look-up before the claim (:func:`recorded_key`) is not atomic with it. While the workers are
    restarted onto the second step of a rotation, some claim under the old secret's key (looking up the
    new one's) and others under the new one's (looking up the old one's): two copies of one intent on
    workers of each kind may both look, both find nothing, and both claim, each under its own key.
    This re-read makes that safe. Of two such claims, the later one's re-read comes after the earlier
    claim and sees it, so at most one of them runs; if both re-reads see the other claim, both
    withdraw and try again after a randomized countdown, and the next look-ups decide. A claim that
    met another key's record is withdrawn (:meth:`Ledger.withdraw`: it never ran, it leaves no trace)
    and rescheduled as an in-flight collision: the next delivery's look-up finds the other key's record
    and follows it. A re-read that fails runs nothing either (:func:`unchecked`).

    It runs on every claim with no sign of having run (:func:`may_have_run`): a new one (``acquired``); one
    this chain takes back (``resumed``: the claim an earlier delivery could not check, which a delivery on a
    worker of the other phase reaches by its look-up without ever looking at its own key); and one taken
    over from a holder that died before running it (``reclaimed``: its check, or its withdrawal, never
    happened). Of two claims of one intent under two keys, the later never ran: its holder's re-read saw the
    earlier one, or never came. A claim that may have run is the intent's, and is not checked: whatever
    record another key has is such a never-run claim, withdrawn by whoever takes it. A holder that writes no
    mark of its own marks its claim before running during a rotation (see :meth:`attempt`), so that a claim
    without a mark never ran. Without a rotation ``other_keys`` is empty and this costs nothing.
    """
    for other in d.other_keys:
        try:
            record = h.ledger.get(other)
        except PayloadKeyError:  # sealed with a key this process lacks: a record all the same
            record = claim.record
        except LedgerError as exc:
            return unchecked(h, d, claim, exc)
        if record is not None:
            return withdrawn(h, d, claim, other, record)
    return None


def withdrawn(h: Settling, d: Delivery, claim: Claim, other: str, record: Record) -> Step:
    """Another key of the intent has a record: withdraw this claim and come back as if it were busy. A claim
    taken over from another holder is not withdrawn but followed to the other key (:func:`follow`)."""
    if not first_of_its_tokens(claim):
        return follow(h, d, claim, other)
    try:
        h.ledger.withdraw(d.key, claim.token)  # False: no longer ours (its lease ran out), nothing to do
    except (LedgerError, NotImplementedError) as exc:
        # Still held, never run: the next delivery takes it back or drops it (see unchecked).
        return h.unavailable(d, exc, carry=d.held(claim.record.owner))
    log.warning("idemmail: %s: another delivery claimed the same intent under another key of a key-secret "
                "rotation (%s) meanwhile; this claim is withdrawn unsent", logsafe(d.key), logsafe(other))
    return h.in_flight(d, record)


def follow(h: Settling, d: Delivery, claim: Claim, other: str) -> Step:
    """A claim taken over during a rotation shows no sign of having run, and another key of the intent has a
    record: the intent is settled under that key, by this delivery, as its record says (replayed, waited for,
    resent with that key, parked, or run if its holder too never ran), and this record then says the same.

    This claim is not withdrawn: its tokens would start again with the next claim of its key, and the holder
    it was taken from (paused, not dead) could act with one of them. Held by this delivery, never run, it is
    left out of the other key's check; unsettled, its lease runs out and whoever takes it comes here again.
    """
    there = replace(d, key=other, older_keys=(), other_keys=tuple(k for k in d.other_keys if k != other))
    owner = d.owner or new_owner(d.attempt_id)
    try:
        found = h.take_back(there, h.ledger.claim(h.request(there, owner)), owner)
    except Exception as exc:  # nothing claimed there, or its reply lost: the next delivery comes here again
        return h.unavailable(d, exc, carry=d.held())
    step = h.settle(there, found)
    copy_final_record(h, d, claim, other)
    return step


def copy_final_record(h: Settling, d: Delivery, claim: Claim, other: str) -> None:
    """Record under ``d.key``, held by ``claim`` and never run, the final record the intent has under
    ``other`` (best effort: unsettled, the claim's lease runs out and its next holder does it)."""
    try:
        record = h.ledger.get(other)
    except LedgerError:
        return
    if record is None or not record.state.is_final:
        return
    if record.state is State.SENT:
        h.guarded(lambda: h.ledger.complete(d.key, claim.token, record.result or {}))
    else:
        move = h.ledger.fail if record.state is State.FAILED else h.ledger.park
        h.guarded(lambda: move(d.key, claim.token, record.error or {"reason": "settled_under_another_key"}))


def unchecked(h: Settling, d: Delivery, claim: Claim, exc: Exception) -> Step:
    """The re-read of :func:`cross_check` failed: run nothing, and wait on the outage budget.

    The claim is withdrawn if the store takes that (a read of another key may fail where this key's
    node answers) and it is the first of its tokens (:func:`first_of_its_tokens`): the next delivery then
    starts over. Otherwise it is still held, never run, and the next
    delivery carries its owner: its look-up finds another key's record (and withdraws this claim,
    :func:`drop_unchecked`), or it takes the claim back (``resumed``) and this check runs again.
    """
    try:
        gone = first_of_its_tokens(claim) and h.ledger.withdraw(d.key, claim.token)
    except (LedgerError, NotImplementedError):
        gone = False
    if not isinstance(exc, (LedgerUnavailableError, UnsafeLedgerError)):
        exc = LedgerUnavailableError(f"rotation re-read after claiming {d.key} failed: {exc}")
    return h.unavailable(d, exc, carry=d.held() if gone else d.held(claim.record.owner))
