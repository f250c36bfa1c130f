"""Bulk sends: one campaign to many recipients, claimed in batches.

``send_campaign`` sends one email per recipient, each under the same intent
key ``send_email(to=recipient, event_id=campaign_id, template=...)`` would
have, so a campaign and a single send never double up. Recipients are claimed
in batches (a Redis pipeline, a multi-row SQL insert), each batch just before
it is sent: claiming everything up front would let leases run out mid-campaign.

The campaign task can be retried, redelivered or run twice as a whole: a
recipient already ``sent`` (or ``failed``, or in ``review``) is skipped in the
batch claim, one whose claim another copy holds is left to that copy and
looked at again on the next pass, and a crashed copy's batch is recovered by
the usual lease rules (resent with the same key when the provider
de-duplicates, parked for review otherwise). Progress is reported as the
Celery task state ``PROGRESS`` with counts, visible in Flower.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from celery import Task, shared_task

from . import outcomes, redaction
from ._lease import keeper
from .errors import (
    InvalidEmail,
    LedgerError,
    PermanentSendError,
    SendError,
    SendNeedsReview,
    TransientSendError,
)
from .keys import Payload
from .ledger import Claim, ClaimRequest, ClaimStatus
from .ledger.base import new_owner
from .ledger.sealed import is_sealed, park_unreadable
from .mail import TASK_NAME as SEND_EMAIL
from .mail import SendEmailTask

log = logging.getLogger("idemmail_celery")

CAMPAIGN_TASK = "idemmail_celery.send_campaign"
DEFAULT_BATCH = 200
MAX_PASSES = 30


@dataclass
class _Recipient:
    to: str
    key: str
    kwargs: dict[str, Any]
    payload: Payload


def _error(exc: BaseException, reason: str, kind: str) -> dict[str, Any]:
    return {"type": kind, "reason": reason, "message": str(exc)[:500], "cause": type(exc).__name__, "at": time.time()}


#: Tally words and the outcome each recipient reports (see :mod:`idemmail_celery.outcomes`).
_STATUS = {"sent": outcomes.SENT, "skipped": outcomes.DUPLICATE, "failed": outcomes.FAILED,
           "review": outcomes.REVIEW, "retry": outcomes.RETRY, "busy": outcomes.IN_FLIGHT}


class _Tally:
    """Counts per campaign run, and one report per recipient outcome (log line and metrics, no event)."""

    def __init__(self, task: Any, counts: Counter[str]) -> None:
        self.task, self.counts = task, counts

    def __call__(self, word: str, key: str, *, message_id: Any = None, reason: str | None = None,
                 **extra: Any) -> None:
        self.counts["retry" if word == "busy" else word] += 1
        if self.task is not None:
            outcomes.report(self.task, _STATUS[word], key, message_id=message_id, reason=reason, event=False,
                            bulk=True, **extra)


def send_batch(sender: SendEmailTask, claims: list[tuple[Claim, _Recipient]], tally: Counter[str],
               task: Any = None) -> None:
    """Send every held claim of a batch once, recording each outcome as ``send_email`` would.

    With ``task`` (the campaign task), each recipient's outcome is reported under its name.
    """
    ledger, provider = sender.ledger, sender.provider
    settings = sender.idem_settings
    carries_key = provider.accepts_idempotency_key
    count = _Tally(task, tally)
    for claim, rcpt in claims:
        key, token = rcpt.key, claim.token
        if claim.status is not ClaimStatus.ACQUIRED and is_sealed(claim.record.payload):
            # Sealed, and this process has no payload keys: never run it, never leave it claimed.
            settled = park_unreadable(ledger, claim)
            if settled.status is ClaimStatus.DONE:
                count("review", key, reason="payload_key_unknown")
            else:
                count("busy", key)  # the next pass
            continue
        if claim.status is ClaimStatus.RECLAIMED and task is not None:
            outcomes.report(task, outcomes.RECLAIMED, key, reclaims=claim.record.reclaims, event=False, bulk=True)
        if claim.status is ClaimStatus.RECLAIMED and not carries_key:
            found = sender.reconcile(key, rcpt.payload)  # a crashed copy may have sent it
            if found is not None:
                ledger.complete(key, token, {"value": found, "message_id": found.get("message_id")})
                count("sent", key, message_id=found.get("message_id"), reason="reconciled")
            else:
                ledger.park(key, token, {"type": "SendNeedsReview", "reason": "lease_expired", "at": time.time()})
                count("review", key, reason="lease_expired")
            continue
        # The first payload ships; if an operator erased it (``forget``), this run's is all there is.
        first = claim.record.payload
        stored = rcpt.payload if claim.status is ClaimStatus.ACQUIRED or not first else Payload.from_json(first)
        keeper.hold(ledger, key, token, settings.lease_seconds)
        try:
            message = sender.message_from(dict(stored.kwargs))
            result = provider.send(message, key=key).to_dict()
        except InvalidEmail as exc:
            ledger.fail(key, token, _error(exc, "invalid_email", "PermanentSendError"))
            count("failed", key, reason="invalid_email")
        except PermanentSendError as exc:
            ledger.fail(key, token, _error(exc, exc.reason, type(exc).__name__))
            count("failed", key, reason=exc.reason)
        except TransientSendError as exc:
            ledger.release(key, token, _error(exc, exc.reason, "TransientSendError"))
            count("retry", key, reason=exc.reason)
        except SendNeedsReview as exc:
            ledger.park(key, token, _error(exc, exc.reason, "SendNeedsReview"))
            count("review", key, reason=exc.reason)
        except Exception as exc:  # ambiguous: it may have been sent
            reason = exc.reason if isinstance(exc, SendError) else "unexpected_error"
            if carries_key:
                ledger.release(key, token, {**_error(exc, reason, "AmbiguousSendError"), "maybe_sent": True})
                count("retry", key, reason=reason)
            else:
                found = sender.reconcile(key, stored)
                if found is not None:
                    ledger.complete(key, token, {"value": found, "message_id": found.get("message_id")})
                    count("sent", key, message_id=found.get("message_id"), reason="reconciled")
                else:
                    ledger.park(key, token, _error(exc, reason, "SendNeedsReview"))
                    count("review", key, reason=reason)
        else:
            ledger.complete(key, token, {"value": result, "message_id": result.get("message_id")})
            count("sent", key, message_id=result.get("message_id"))
        finally:
            keeper.drop(ledger, key, token)


def _send_campaign(
    self: Task,
    *,
    campaign_id: str,
    recipients: list[str],
    subject: str,
    text: str | None = None,
    html: str | None = None,
    from_: str | None = None,
    template: str | None = None,
    tenant: str | None = None,
    headers: dict[str, str] | None = None,
    tags: dict[str, str] | None = None,
    batch_size: int = DEFAULT_BATCH,
) -> dict[str, Any]:
    """Send one email per recipient, once each, however often this task runs.

    Returns counts: ``sent`` (this run), ``skipped`` (already final), ``failed``,
    ``review``, ``total``. While it runs the task state is ``PROGRESS`` with the
    same counts. Recipients held by another copy, or released for a transient
    error, are retried by rescheduling this task (at most ``MAX_PASSES`` passes).
    """
    sender: SendEmailTask = self.app.tasks[SEND_EMAIL]
    builder, settings = sender.key_builder, sender.idem_settings
    base = {"subject": subject, "text": text, "html": html, "from_": from_, "event_id": campaign_id,
            "template": template, "tenant": tenant, "headers": headers, "tags": tags}
    base = {k: v for k, v in base.items() if v is not None}
    sender.check_call((), {**base, "to": recipients[0]} if recipients else base)  # fail the whole run early

    tally: Counter[str] = Counter()
    unique = list(dict.fromkeys(recipients))
    for start in range(0, len(unique), max(1, batch_size)):
        batch = []
        for to in unique[start:start + batch_size]:
            kwargs = {**base, "to": to}
            payload = builder.payload((), kwargs)
            batch.append(_Recipient(to, builder.derive(payload, tenant=tenant), kwargs, payload))
        owner = new_owner(f"{self.request.id or 'campaign'}")
        try:
            claims = sender.ledger.claim_many([
                ClaimRequest(key=r.key, task_name=sender.name, payload=r.payload.to_json(),
                             fingerprint=builder.fingerprint(r.payload), owner=owner,
                             lease_seconds=settings.lease_seconds)
                for r in batch
            ])
        except LedgerError as exc:  # fail closed: nothing sent without claims; come back later
            raise self.retry(exc=exc, countdown=min(60.0, 2.0 ** min(self.request.retries, 6))) from exc
        held = []
        count = _Tally(self, tally)
        for claim, rcpt in zip(claims, batch, strict=True):
            if claim.status is ClaimStatus.DONE:
                count("skipped", rcpt.key, message_id=(claim.record.result or {}).get("message_id"),
                      recorded=claim.record.state.value)
            elif claim.status is ClaimStatus.BUSY:
                count("busy", rcpt.key)
            else:
                held.append((claim, rcpt))
        send_batch(sender, held, tally, self)
        progress = {"total": len(unique), "processed": min(start + batch_size, len(unique)), **tally}
        self.update_state(state="PROGRESS", meta=progress)

    if tally["retry"]:
        if self.request.retries >= MAX_PASSES:
            log.error("idemmail: campaign %s still has %d recipients pending after %d passes",
                      campaign_id, tally["retry"], self.request.retries)
        else:
            countdown = min(settings.inflight_backoff_max, settings.inflight_backoff * 2 ** self.request.retries)
            raise self.retry(countdown=countdown)
    return {"campaign_id": campaign_id, "total": len(unique), "sent": tally["sent"], "skipped": tally["skipped"],
            "failed": tally["failed"], "review": tally["review"], "pending": tally["retry"]}


send_campaign: Task = shared_task(
    bind=True, name=CAMPAIGN_TASK, acks_late=True, reject_on_worker_lost=True, max_retries=None
)(_send_campaign)
# Its arguments are a recipient list, a subject and bodies: never shown (Flower, events, worker logs).
redaction.register(CAMPAIGN_TASK)
