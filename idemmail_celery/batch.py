"""Many deliveries at once: :meth:`Handler.handle_many <idemmail_celery.handler.Handler.handle_many>`, for
campaigns (``bulk.py``). The steps of one delivery, with the batch's claims made in one round trip
(:meth:`Ledger.claim_many`) and every held lease renewed while the batch runs. A delivery's own failure is its
step; a failure of the batch's claim (or of a rotation's look-up before it) is raised to the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ._lease import keeper
from .chain import Carry, Verdict
from .errors import LedgerError, SendNeedsReview
from .ledger import Claim
from .steps import Action, Delivery, Outcome, Settling, Step, error_record

log = logging.getLogger("idemmail_celery")


def handle_many(h: Settling, deliveries: Sequence[Delivery], *, owner: str, last: bool = False) -> list[Step]:
    """One step per delivery, in order; ``deliveries`` have distinct keys and claim as ``owner``. On the
    ``last`` pass nothing is left held: a delivery whose settling failed unexpectedly is parked for review.

    Raises :class:`LedgerError` when the batch claim (or a rotation's look-up) fails: nothing was sent, and
    the caller's next batch takes any landed claim back (``owner`` among its ``resume_owners``).
    """
    steps: dict[int, Step] = {}
    claimable = []
    deliveries = list(deliveries)
    for i, d in enumerate(deliveries):
        refused = h.check(d)
        if refused is not None:
            steps[i] = refused
            continue
        if d.older_keys:  # during a key-secret rotation: a delivery recorded under an older key stays there
            deliveries[i] = h.recorded_key(d)
        claimable.append(i)
    claims = h.ledger.claim_many([h.request(deliveries[i], owner) for i in claimable])
    for n, (i, c) in enumerate(zip(claimable, claims, strict=True)):
        try:  # held under an older owner of the caller's (a batch claim whose reply was lost): taken back
            claims[n] = h.take_back(deliveries[i], c, owner)
        except LedgerError as exc:  # left busy: the next batch tries again, with this one's owners
            log.warning("idemmail: taking a batch delivery's claim back failed (%s)", type(exc).__name__)
    held = [c for c in claims if c.status.holds]
    lease = h.policy.lease_seconds
    for c in held:  # renewed while the batch runs, not only while each one is sent
        keeper.hold(h.ledger, c.record.key, c.token, lease)
    try:
        for i, claim in zip(claimable, claims, strict=True):
            steps[i] = _settled(h, deliveries[i], claim, last=last)
            if claim.status.holds:
                keeper.drop(h.ledger, claim.record.key, claim.token)
    finally:
        for c in held:
            keeper.drop(h.ledger, c.record.key, c.token)
    return [steps[i] for i in range(len(deliveries))]


def _settled(h: Settling, d: Delivery, claim: Claim, *, last: bool) -> Step:
    """One delivery of the batch, exactly as a single one (a busy one is left to its holder for the next batch)."""
    try:
        return h.settle(d, claim)
    except Exception as exc:  # a defect must not cancel the batch
        log.exception("idemmail: settling a batch delivery failed (%s)", type(exc).__name__)
        if not claim.status.holds or (h.effect.carries_key() and not last):  # safe to run again: next batch
            return Step(Outcome.ERROR, Action.RESCHEDULE, d.key, error=exc)
        # It may have been sent, and nothing downstream de-duplicates: parked (or the next batch records that).
        error = error_record(exc, "unexpected_error", SendNeedsReview)
        try:
            return h.park_unknown(d, claim, "unexpected_error",
                                  f"settling failed ({type(exc).__name__}); it may have been sent")
        except Exception:
            log.exception("idemmail: parking a batch delivery failed; the next batch records it")
            return Step(Outcome.ERROR, Action.RESCHEDULE, d.key, error=exc,
                        carry=Carry(verdict=Verdict("review", error=error)))
