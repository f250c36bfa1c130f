"""Bulk sends: one campaign to many recipients, each under the key ``send_email(to=recipient, event_id=campaign_id,
template=...)`` would have, claimed in batches just before sending and settled by the one state machine
(:class:`~idemmail_celery.handler.Handler`); a pass leaving recipients pending publishes another (docs/bulk.md)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from celery import Task, shared_task

from . import outcomes, redaction
from ._common import backoff, logsafe, transport_visibility_timeout
from .chain import (
    KEY_MARK_HEADER,
    SEALED_HEADERS,
    ChainState,
    Verdict,
    campaign_pass_headers,
    campaign_verdicts,
    held_by,
    owners_of,
)
from .config import Settings
from .errors import ConfigurationError, IdemmailError, LedgerError
from .handler import INVALID_INPUT, Delivery, Handler, Outcome, Policy, Step, say_setup_error_once
from .keys import Payload, Seal, untrusted_removed
from .ledger.base import new_owner
from .mail import TASK_NAME as SEND_EMAIL
from .mail import SendEmailTask
from .republish import Republisher

log = logging.getLogger("idemmail_celery")

CAMPAIGN_TASK = "idemmail_celery.send_campaign"
DEFAULT_BATCH = 200
MAX_PASSES = 30

#: How each recipient's outcome counts in the campaign's result (see :class:`~idemmail_celery.handler.Outcome`).
_TALLY = {Outcome.SENT: Outcome.SENT, Outcome.DUPLICATE: Outcome.DUPLICATE, Outcome.FAILED: Outcome.FAILED,
          Outcome.REVIEW: Outcome.REVIEW, Outcome.KEY_REUSE: Outcome.FAILED}


class CampaignEffect:
    """``send_email``'s side effect for one recipient at a time, reported under the campaign task."""

    def __init__(self, sender: SendEmailTask, campaign: Any = None) -> None:
        self.sender, self.campaign = sender, campaign

    def check(self, payload: Payload) -> None:
        self.sender.check(payload)

    def perform(self, payload: Payload, key: str) -> Any:
        return self.sender.deliver(dict(payload.kwargs), key)

    def carries_key(self) -> bool:
        return self.sender.carries_key()

    def writes_ahead(self) -> bool:
        return self.sender.writes_ahead()

    def reconcile(self, key: str, payload: Payload) -> Any | None:
        return self.sender.reconcile(key, payload)

    def report(self, outcome: Outcome, key: str, **fields: Any) -> None:
        if self.campaign is not None:  # a recipient's outcome: a log line and metrics, no event
            outcomes.report(self.campaign, outcome, key, event=False, bulk=True, **fields)


@dataclass
class BatchResult:
    """What one batch came to: a step per recipient, in order, and the deliveries' own keys (not always the steps')."""

    steps: list[Step]
    keys: list[str]

    def outcomes(self) -> list[Outcome]:
        """Each recipient's outcome as a campaign counts it: sent, duplicate, failed, review or pending."""
        return [_TALLY.get(s.outcome, Outcome.PENDING) for s in self.steps]

    def tally(self) -> Counter[Outcome]:
        """Recipients per outcome: sent, duplicate, failed, review, pending."""
        return Counter(self.outcomes())

    def verdicts(self) -> dict[str, dict[str, Any]]:
        """Verdicts reached and not recorded yet, by their claim's key, each with the owners its claim is held by."""
        return {s.key: {**s.carry.verdict.to_header(), "owner": list(s.carry.owners) or None}
                for s in self.steps if s.carry.verdict is not None}

    def settled_keys(self) -> set[str]:
        """Every key (the deliveries' and their claims') this batch settled a recipient under: not a pending one."""
        return {k for key, step, outcome in zip(self.keys, self.steps, self.outcomes(), strict=True)
                if outcome is not Outcome.PENDING for k in (key, step.key)}


def send_batch(handler: Handler, deliveries: Sequence[Delivery], *, owner: str, last: bool = False) -> BatchResult:
    """One batch through :meth:`Handler.handle_many`; raises (:class:`LedgerError`) only for the batch's claim."""
    return BatchResult(handler.handle_many(deliveries, owner=owner, last=last), [d.key for d in deliveries])


def _send_campaign(self: Task, *, campaign_id: str, recipients: list[str], subject: str, text: str | None = None,
                   html: str | None = None, from_: str | None = None, template: str | None = None,
                   tenant: str | None = None, headers: dict[str, str] | None = None,
                   tags: dict[str, str] | None = None, batch_size: int = DEFAULT_BATCH) -> dict[str, Any]:
    """Send one email per recipient, once each, however often this task runs; returns (and while it runs, reports
    as the state ``PROGRESS``) counts by outcome and ``total``; pending ones get more passes (``MAX_PASSES``)."""
    sender: SendEmailTask = self.app.tasks[SEND_EMAIL]
    try:
        request_headers = _trusted(self, sender)  # its seal check raises what the key builder's settings raise
    except IdemmailError as exc:  # no key secret, bad settings: its pass state cannot be read here, nor kept
        sender.wait_as_received(exc, running=self)
    base = {"subject": subject, "text": text, "html": html, "from_": from_, "event_id": campaign_id,
            "template": template, "tenant": tenant, "headers": headers, "tags": tags}
    base = {k: v for k, v in base.items() if v is not None}
    owner = new_owner(self.request.id or "campaign")
    # Earlier passes' owners travel on: a batch claim whose reply was lost may or may not have landed.
    chain = ChainState.from_headers(request_headers)
    owners = list(held_by(owner, chain.owners))
    verdicts = campaign_verdicts(request_headers)
    resumed = _Resumed.of(chain.campaign, len(recipients))
    # Neither running out of time nor waiting on an outage is a retry of the campaign.
    passes = max(0, (self.request.retries or 0) - resumed.continued - resumed.outages)
    policy = sender.policy_or_default()
    try:
        sender.check_call((), {**base, "to": recipients[0]} if recipients else base)  # fail the whole run early
        sender.ensure_announced()  # no key or claim before this worker is in the roster and has read it
        builder = sender.key_builder  # after the roster's read: the order of several secrets follows it
        handler = Handler(sender.ledger, builder, policy, CampaignEffect(sender, self))
    except INVALID_INPUT:
        raise
    except Exception as exc:  # the ledger does not answer, or this worker cannot send now: wait on the outage budget
        if not isinstance(exc, LedgerError) or isinstance(exc, ConfigurationError):  # a set-up error: its fix, once
            say_setup_error_once(exc)
        raise _again(self, policy, exc, owners, verdicts, passes, resumed, outage=True) from exc
    deliveries, recipient_of = _unique(builder, base, recipients, tenant, self.request, owners, verdicts, passes)
    if resumed.start > len(deliveries):  # not this list's place: the whole list (the ledger skips the settled)
        resumed = _Resumed(continued=resumed.continued, outages=resumed.outages)
    return CampaignPass(self, handler, policy, campaign_id, owners, deliveries, recipient_of, resumed,
                        passes, max(1, int(batch_size)), pass_seconds(self.app, sender.idem_settings),
                        verdicts=dict(verdicts)).run()


@dataclass
class CampaignPass:
    """One pass of a campaign over its list, from where the last pass handed on: claims in batches (recipients
    with a verdict to record first) and counts what each came to; it may publish another pass (:meth:`again`)."""

    task: Task
    handler: Handler
    policy: Policy
    campaign_id: str
    #: Every owner whose claims this pass may hold or find held, newest first: its own first.
    owners: list[str]
    deliveries: list[Delivery]
    #: Each key a recipient may be recorded under -> its place in the list.
    recipient_of: dict[str, int]
    resumed: _Resumed
    passes: int
    size: int
    #: How long this pass may run (:func:`pass_seconds`) before it hands the rest of the list on.
    budget: float
    #: Verdicts still to record: those this pass came with (until settled), and those it reaches and cannot record.
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    tally: Counter[Outcome] = field(default_factory=Counter)
    #: Recipients with a verdict, settled ahead of their place in the list: counted when the list reaches them.
    early: dict[str, Outcome] = field(default_factory=dict)
    #: Recipients with a verdict before where this pass starts: the pass that handed on counted them pending.
    behind: set[str] = field(default_factory=set)

    @property
    def owner(self) -> str:
        """This pass's claim owner."""
        return self.owners[0]

    @property
    def last(self) -> bool:
        """Is this the last pass MAX_PASSES allows? A recipient then left pending is left to whoever holds it."""
        return self.passes >= MAX_PASSES

    def run(self) -> dict[str, Any]:
        """Go over the list (or stop early, raising the next pass) and return the campaign's counts."""
        self.tally.update(dict(self.resumed.tally))
        self.behind = {d.key for d in self.deliveries[:self.resumed.start] if d.verdict is not None}
        # Those before where this pass starts were counted pending by the pass that handed on: counted again now.
        self.tally[Outcome.PENDING] = max(0, self.tally[Outcome.PENDING] - len(self.behind))
        started = time.monotonic()
        for at, claimant, chunk in self.batches():
            if at is not None and at > self.resumed.start and time.monotonic() - started >= self.budget:
                _yield_pass(self.task, self.policy, self.owners, self.verdicts, self.passes, at, self.tally,
                            self.resumed)
            chunk = self.not_counted_yet(at, chunk)
            if chunk:
                self.send(at, claimant, chunk)
        return self.result()

    def again(self, exc: BaseException | None, *, outage: bool = False) -> BaseException:
        """The next pass over the whole list (see :func:`_again`)."""
        return _again(self.task, self.policy, exc, self.owners, self.verdicts, self.passes, self.resumed, outage=outage)

    def batches(self) -> list[tuple[int | None, str, list[Delivery]]]:
        """The batches in claim order, each with its place in the list (None: ahead of it) and the owner it claims
        as: recipients with a verdict to record first, as the owner that holds them (a verdict is never sent)."""
        holders: dict[str, list[Delivery]] = {}
        for d in self.deliveries:
            if d.verdict is not None:
                holders.setdefault(self.handler.claimant(d), []).append(d)
        size = self.size
        out: list[tuple[int | None, str, list[Delivery]]] = [
            (None, holder, held[i:i + size]) for holder, held in holders.items() for i in range(0, len(held), size)]
        return out + [(i, self.owner, self.deliveries[i:i + size])
                      for i in range(self.resumed.start, len(self.deliveries), size)]

    def not_counted_yet(self, at: int | None, chunk: list[Delivery]) -> list[Delivery]:
        """``chunk`` less the recipients recorded first in this pass: counted here, not sent for again."""
        if at is None:
            return chunk
        recorded = [d.key for d in chunk if d.key in self.early]
        self.tally.update(self.early.pop(key) for key in recorded)
        return [d for d in chunk if d.key not in recorded]

    def send(self, at: int | None, claimant: str, chunk: list[Delivery]) -> None:
        """Claim and settle one batch, count it, and keep the verdicts it could not record."""
        try:
            batch = send_batch(self.handler, chunk, owner=claimant, last=self.last)
        except Exception as exc:  # the ledger failed (or worse): nothing more sent; this pass's claims are ours
            if not isinstance(exc, LedgerError):
                log.exception("idemmail: campaign %s batch failed; retrying the campaign", logsafe(self.campaign_id))
            raise self.again(exc) from exc
        self.count(at, chunk, batch)
        for key in batch.settled_keys():
            self.verdicts.pop(key, None)
        # Each verdict says which recipient it is, so a pass with other key secrets finds its claim all the same.
        self.verdicts.update({k: {**v, "recipient": self.recipient_of.get(k)} for k, v in batch.verdicts().items()})
        setup = next((s.error for s in batch.steps if s.outcome is Outcome.SETUP_ERROR), None)
        if setup is not None:  # the rest of the list meets it too: wait on the outage budget, as send_email does
            raise self.again(setup, outage=True) from setup
        self.progress(self.resumed.start if at is None else min(at + self.size, len(self.deliveries)))

    def count(self, at: int | None, chunk: list[Delivery], batch: BatchResult) -> None:
        if at is not None:
            self.tally.update(batch.tally())
            return
        for d, outcome in zip(chunk, batch.outcomes(), strict=True):
            if d.key in self.behind:
                self.tally[outcome] += 1
            else:
                self.early[d.key] = outcome

    def progress(self, processed: int) -> None:
        """The task state ``PROGRESS`` with the counts so far (best effort)."""
        meta = {"total": len(self.deliveries), "processed": processed, **{o.value: n for o, n in self.tally.items()}}
        try:
            self.task.update_state(state="PROGRESS", meta=meta)
        except Exception as exc:  # progress is best effort: a result backend blip must not stop the campaign
            log.warning("idemmail: campaign %s progress not stored: %s", logsafe(self.campaign_id), type(exc).__name__)

    def result(self) -> dict[str, Any]:
        tally = self.tally
        if self.verdicts or (tally[Outcome.PENDING] and not self.last):
            # Verdicts of this campaign's own sends are never given up on: their claims would be left to nobody.
            raise self.again(None)
        if tally[Outcome.PENDING]:  # held by other deliveries after MAX_PASSES: theirs to settle
            log.warning("idemmail: campaign %s leaves %d recipients to the deliveries holding them after %d passes",
                        logsafe(self.campaign_id), tally[Outcome.PENDING], self.passes)
        return {"campaign_id": self.campaign_id, "total": len(self.deliveries),
                **{o.value: tally[o] for o in (Outcome.SENT, Outcome.DUPLICATE, Outcome.FAILED, Outcome.REVIEW,
                                                Outcome.PENDING)}}


def pass_seconds(app: Any, settings: Settings) -> float:
    """How long one pass may run: ``idemmail_campaign_pass_seconds``, else half the visibility timeout, else 900 s."""
    if settings.campaign_pass_seconds is not None:
        return float(settings.campaign_pass_seconds)
    vt = transport_visibility_timeout(app)
    return vt / 2 if vt is not None else 900.0


@dataclass(frozen=True)
class _Resumed:
    """The ``idemmail_campaign`` header: where the next pass starts, counts so far, passes that only ran out of time
    (``continued``) or waited on an outage (``outages``)."""

    start: int = 0
    tally: tuple[tuple[Outcome, int], ...] = ()
    continued: int = 0
    outages: int = 0

    @classmethod
    def of(cls, header: Any, total: int) -> _Resumed:
        """The header read back; anything malformed starts over (the ledger answers for recipients settled)."""
        if not isinstance(header, dict):
            return cls()
        start, continued, counts = header.get("from"), header.get("continued"), header.get("tally")
        outages = header.get("outages", 0)
        if not (isinstance(start, int) and isinstance(continued, int) and isinstance(counts, dict)
                and isinstance(outages, int) and 0 <= start <= total and continued >= 0 and outages >= 0):
            return cls()
        try:
            tally = tuple((Outcome(k), int(v)) for k, v in counts.items())
        except (ValueError, TypeError):
            return cls()
        return cls(start, tally, continued, outages)

    def header(self, start: int = 0, tally: Counter[Outcome] | None = None, *, continued: int = 0,
               outages: int = 0) -> dict[str, Any] | None:
        """The header the next pass gets (None when there is nothing to hand on)."""
        counts = {o.value: c for o, c in (tally or Counter()).items()}
        head = {"from": start, "tally": counts, "continued": self.continued + continued,
                "outages": self.outages + outages}
        return head if start or counts or head["continued"] or head["outages"] else None


def _yield_pass(task: Task, policy: Policy, owners: list[str], verdicts: dict[str, Any], passes: int, start: int,
                tally: Counter[Outcome], resumed: _Resumed) -> NoReturn:
    """End this pass before the broker hands its message out again: the next one starts at ``start``."""
    log.info("idemmail: campaign pass ran for its time; the next one starts at recipient %d", start)
    countdown = _countdown(task, policy, passes, verdicts) if verdicts else 0
    _next_pass(task, countdown, owners, verdicts, resumed.header(start, tally, continued=1), None)


def _unique(builder: Any, base: dict[str, Any], recipients: list[str], tenant: str | None, request: Any,
            owners: list[str], verdicts: dict[str, Any], passes: int) -> tuple[list[Delivery], dict[str, int]]:
    """One delivery per intent (a recipient with a verdict claims under the verdict's key), and each key a
    recipient may be recorded under -> its place in ``recipients``."""
    out: dict[str, Delivery] = {}
    recipient_of: dict[str, int] = {}
    owner, resume = owners[0], tuple(owners[1:])
    by_place = {v["recipient"]: k for k, v in verdicts.items()
                if isinstance(v, dict) and isinstance(v.get("recipient"), int)}
    for place, to in enumerate(recipients):
        payload = builder.payload((), {**base, "to": to})
        older: tuple[str, ...] = ()
        try:
            key = builder.derive(payload, tenant=tenant)
            older = builder.older_keys(payload, tenant=tenant)  # () unless the key secret is being rotated
        except Exception:  # an address the key cannot be made of: the check refuses it below, by name
            key = f"invalid:{len(out)}"
        if key in out:
            continue
        claim_key = next((k for k in (key, *older) if k in verdicts), None) or by_place.get(place)
        carried = verdicts.get(claim_key) if claim_key is not None else None
        verdict = Verdict.from_header(carried)
        for k in (key, *older, *([claim_key] if verdict is not None else [])):
            recipient_of.setdefault(str(k), place)
        holders = owners_of(carried.get("owner")) if verdict is not None and isinstance(carried, dict) else ()
        out[key] = Delivery(key=str(claim_key) if verdict is not None else key, task_name=SEND_EMAIL,
                            payload=payload, attempt_id=request.id or "", retries=passes, max_retries=MAX_PASSES,
                            owner=owner, resume_owners=holders or resume, verdict=verdict,
                            older_keys=() if verdict is not None else older)
    return list(out.values()), recipient_of


def _again(task: Task, policy: Policy, exc: BaseException | None, owners: list[str],
           verdicts: dict[str, Any], passes: int, resumed: _Resumed, *, outage: bool = False) -> BaseException:
    """Publish the next pass over the whole list; past the budget (``idemmail_outage_max_retries`` for an outage,
    else ``MAX_PASSES``), return ``exc`` for the campaign to fail with. Campaigns never fail open."""
    outage = outage or (exc is not None and waits_on_outage(exc))
    if exc is not None:
        budget, spent = (policy.outage_max_retries, resumed.outages) if outage else (MAX_PASSES, passes)
        if budget is not None and spent >= budget:
            log.error("idemmail: campaign gives up after %d passes: %s", spent, type(exc).__name__)
            return exc
    countdown = _countdown(task, policy, resumed.outages if outage else passes, verdicts)
    _next_pass(task, countdown, owners, verdicts, resumed.header(outages=int(outage)), exc)


def waits_on_outage(exc: BaseException) -> bool:
    """Does a pass that met ``exc`` wait on the outage budget (the ledger, or a set-up error: nothing sent)?"""
    return isinstance(exc, (LedgerError, ConfigurationError, ImportError))


def _next_pass(task: Task, countdown: float, owners: list[str], verdicts: dict[str, Any],
               resume: dict[str, Any] | None, reason: BaseException | None) -> NoReturn:
    """Publish the next pass with this pass's state in place of the one it came with, sealed last."""
    sender: SendEmailTask = task.app.tasks[SEND_EMAIL]
    headers = campaign_pass_headers(untrusted_removed(task.request.headers or {}, keep=()), owners, verdicts, resume)

    def seal(headers: dict[str, Any]) -> None:
        headers[KEY_MARK_HEADER] = sender.key_builder.seal(headers, _campaign_call(task), task_name=CAMPAIGN_TASK)

    Republisher(sender).next_pass(task, countdown, headers, "next campaign pass", reason, seal)


def _campaign_call(task: Task) -> Payload:
    return Payload(list(task.request.args or ()), dict(task.request.kwargs or {}))


def _trusted(task: Task, sender: SendEmailTask) -> dict[str, Any]:
    """This pass's headers, less the pass state unless this campaign sealed it (a forged verdict would record a send
    that never happened; one WARNING). A seal under a secret this worker lacks waits for a worker that has it."""
    headers = dict(task.request.headers or {})
    check = sender.key_builder.check_seal(headers, _campaign_call(task), task_name=CAMPAIGN_TASK)
    if check is Seal.VALID:
        return headers
    if check is Seal.UNKNOWN_SECRET:
        sender.wait_for_key_secret(headers, running=task)
    ignored = sorted(k for k in headers if k in SEALED_HEADERS or k == KEY_MARK_HEADER)
    if ignored:
        log.warning("idemmail: campaign %s carries pass state the library did not seal for it (%s: %s); it is "
                    "ignored", logsafe(task.request.id), check.value, ", ".join(ignored))
    return untrusted_removed(headers, keep=())


def _countdown(task: Task, policy: Policy, passes: int, verdicts: dict[str, Any]) -> float:
    """The wait before the next pass: backoff, below the visibility timeout and (with verdicts) a third of the lease."""
    countdown = backoff(passes, policy.inflight_backoff, policy.inflight_backoff_max)
    if verdicts:
        countdown = min(countdown, policy.lease_seconds / 3)
    vt = transport_visibility_timeout(task.app)
    return min(countdown, vt / 2) if vt is not None else countdown


send_campaign: Task = shared_task(
    bind=True, name=CAMPAIGN_TASK, acks_late=True, reject_on_worker_lost=True, max_retries=None
)(_send_campaign)
# Its arguments are a recipient list, a subject and bodies: never shown (Flower, events, worker logs).
redaction.register(CAMPAIGN_TASK)
