"""Key-secret rotation: how a claim stays the intent's only one while its key has two forms (docs/security.md).

Before the claim, :func:`recorded_key` finds the key the intent is already recorded under; between a new claim
and anything it runs, :func:`cross_check` reads the other keys again (the look-up and the claim are not
atomic). Without a rotation nothing here runs (``Delivery.older_keys`` and ``other_keys`` are empty).
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
    """During a rotation: the delivery under the older key its intent is recorded with, if any. Raises
    :class:`LedgerUnavailableError` (or :class:`UnsafeLedgerError`) when a read fails: claiming under the new
    key could then send an intent recorded under an old one."""
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
    """The intent is recorded under another key: a claim this chain may hold under ``d.key`` that never ran is
    withdrawn, so nobody takes it over later and sends the intent again (one with a reclaim or a mark is left
    alone). Raises like :func:`recorded_key`."""
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
    """Between a claim with no sign of having run (:func:`may_have_run`) and anything it runs, read the
    intent's other keys again: None if none has a record. Why this is safe, and which claims it covers:
    docs/security.md (two copies at once)."""
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
    """A claim taken over shows no sign of having run, and another key of the intent has a record: the intent
    is settled under that key as its record says, and this record then says the same. Not withdrawn: its
    tokens would start again, and the holder it was taken from may only be paused."""
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
    """The re-read of :func:`cross_check` failed: run nothing, wait on the outage budget. The claim is
    withdrawn when it is the first of its tokens and the store takes that; else the next delivery carries
    its owner and finds the other record (:func:`drop_unchecked`) or checks again."""
    try:
        gone = first_of_its_tokens(claim) and h.ledger.withdraw(d.key, claim.token)
    except (LedgerError, NotImplementedError):
        gone = False
    if not isinstance(exc, (LedgerUnavailableError, UnsafeLedgerError)):
        exc = LedgerUnavailableError(f"rotation re-read after claiming {d.key} failed: {exc}")
    return h.unavailable(d, exc, carry=d.held() if gone else d.held(claim.record.owner))
