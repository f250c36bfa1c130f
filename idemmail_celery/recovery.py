"""What a held claim with a past decides: a dead holder behind it, a ledger loss since its message was
enqueued, or a message older than the ledger's retention. The handler's gates call these; each answers None
(run) or the step that ends the delivery (reconciled, parked, never a guess).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ._common import logsafe
from .ledger import Claim, ClaimStatus
from .steps import Delivery, Outcome, Settling, Step, live_mark

log = logging.getLogger("idemmail_celery")

#: How long after an acknowledged ledger loss an undated message counts as possibly older than the loss.
UNDATED_AFTER_LOSS_SECONDS = 24 * 3600.0
#: The review reason of a new claim for a message older than the ledger's retention.
OLDER_THAN_RETENTION = "older_than_retention"
#: What :func:`older_than_retention` allows for the caller's clock being behind (at most a tenth of the retention).
RETENTION_SKEW_SECONDS = 60.0


def after_crash(h: Settling, d: Delivery, claim: Claim) -> Step | None:
    """A reclaimed expired lease (or a resumed claim an earlier delivery marked): its holder died,
    maybe mid-send. None: run again (with the key, or because it surely did not send)."""
    record = claim.record
    mark = live_mark(claim, d.resume_owners)
    h.effect.report(Outcome.RECLAIMED, d.key, reclaims=record.reclaims)
    extra: dict[str, Any] = {}
    if record.reclaims > h.policy.max_reclaims:
        reason = "reclaim_limit"  # a poison message that kills its worker every time
    elif not h.effect.carries_key():
        if mark is None and claim.previous_writes_ahead and (
                claim.status is ClaimStatus.RECLAIMED or h.ledger.marks_takeovers):
            # Its holder would have marked the ledger before sending, and did not (a takeover from a holder
            # that made no promise is marked by the store, so a resumed claim without a mark is safe too).
            log.warning("idemmail: %s reclaimed after an expired lease; its holder had not begun the "
                        "send (no write-ahead mark): sending it now", logsafe(d.key))
            return None
        found = h.reconciled(d, record)
        if found is not None:  # the provider has it: record the truth, do not send again
            return h.record_sent(d, claim, found, reconciled=True)
        reason = "lease_expired"  # it may have sent, and nothing downstream would dedupe
        if mark is not None:
            extra["stage"] = mark.stage
    else:
        log.warning("idemmail: %s reclaimed after an expired lease; resending with the same key", logsafe(d.key))
        return None
    reached = f" after its write-ahead mark ({extra['stage']})" if extra else ""
    holder = claim.previous_owner or "the previous holder"
    return h.park_unknown(d, claim, reason, f"{holder} lost its lease{reached} "
                                               f"(reclaims: {record.reclaims})", **extra)


def older_than_loss(h: Settling, d: Delivery) -> bool:
    """Was this message enqueued before an acknowledged ledger loss (``Ledger.recovered_at``)?"""
    recovered_at = h.ledger.recovered_at
    if recovered_at is None:
        return False
    if d.enqueued_at is None:  # undated: suspect while the loss is recent
        return time.time() - recovered_at < UNDATED_AFTER_LOSS_SECONDS
    return d.enqueued_at < recovered_at


def after_loss(h: Settling, d: Delivery, claim: Claim) -> Step | None:
    """A new claim for a message enqueued before an acknowledged ledger loss (its record may be what was lost):
    with the key carried downstream, run (None); otherwise reconciled, or parked."""
    if h.effect.carries_key():
        return None
    found = h.reconciled(d, claim.record)
    if found is not None:
        return h.record_sent(d, claim, found, reconciled=True)
    return h.park_unknown(d, claim, "ledger_lost", "enqueued before an acknowledged ledger loss: it may have "
                                                      "been sent, and the record of it lost")


def older_than_retention(h: Settling, d: Delivery) -> bool:
    """Is this message older than what the ledger can vouch for? A record it made is no older than its
    enqueue or due time, and a final one is kept for the retention after that: a new claim for an older
    message may be a copy of an intent sent and expired. An undated message cannot be told: it is not."""
    if d.enqueued_at is None:
        return False
    retention = h.ledger.retention_seconds
    age = time.time() - max(d.enqueued_at, d.due_at or 0.0)
    return age > retention - min(RETENTION_SKEW_SECONDS, retention / 10)


def after_retention(h: Settling, d: Delivery, claim: Claim) -> Step:
    """A new claim for a message older than the retention: reconciled, else parked (``older_than_retention``).
    A key carried downstream does not make it safe (a service de-duplicates for a day or so)."""
    found = h.reconciled(d, claim.record)
    if found is not None:
        return h.record_sent(d, claim, found, reconciled=True)
    age = time.time() - max(d.enqueued_at or 0.0, d.due_at or 0.0)
    return h.park_unknown(d, claim, OLDER_THAN_RETENTION,
                             f"enqueued {age:.0f} s ago, longer than the ledger keeps records "
                             f"({h.ledger.retention_seconds:.0f} s): a copy of it may have been sent, "
                             "and its record expired")
