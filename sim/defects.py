"""Planted defects: each one breaks one mechanism the guarantee rests on, by monkeypatch, and names
the worlds in which the simulator must then report a violation (``make sim`` and tests/test_sim.py
require it to, within 60 s each). The first eight are issue 36's; the rest come from the project's
own history."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import idemmail_celery.bulk as bulk
import idemmail_celery.handler as handler_mod
import idemmail_celery.recovery as recovery
import idemmail_celery.redrive as redrive
from idemmail_celery.chain import Carry
from idemmail_celery.errors import LedgerError
from idemmail_celery.handler import Action, Delivery, Handler, Outcome, Step
from idemmail_celery.ledger import State

from . import ledger as sim_ledger
from .world import Config, patched

Patch = tuple[Any, str, Any]


def _unfenced(original: Callable[..., Any]) -> Callable[..., Any]:
    def finish(self: sim_ledger.MemLedger, key: str, token: int, state: State, **kw: Any) -> Any:
        seen = self.records.get(key)
        if seen is not None and seen.state is State.CLAIMED:
            token = seen.token  # whoever holds it now: the token no longer fences anything
        return original(self, key, token, state, **kw)
    return finish


def _no_owner_held(original: Callable[..., Carry]) -> Callable[..., Carry]:
    def held(d: Any, owner: str | None = None) -> Carry:
        return replace(original(d, owner), owners=())
    return held


def _released_ambiguity(original: Callable[..., Step]) -> Callable[..., Step]:
    def retry_or_park(self: Handler, d: Any, claim: Any, exc: Exception, reason: str, *, sent_maybe: bool) -> Step:
        return original(self, d, claim, exc, reason, sent_maybe=False)
    return retry_or_park


def _sweep_ignoring_leases(original: Callable[..., list[str]]) -> Callable[..., list[str]]:
    def sweep(ledger: Any, tasks: Any, after_seconds: float, now: float, limit: int) -> list[str]:
        return original(ledger, tasks, -1.0, now + 10 * after_seconds, limit)
    return sweep


def _mark_after_send(self: Handler, d: Any, claim: Any) -> Callable[[str], None]:
    def mark(stage: str) -> None:
        return None  # the provider goes on at once; the mark was to be written once it answered
    return mark


def _drop_lost_batches(original: Callable[..., Any]) -> Callable[..., Any]:
    def send_batch(handler: Handler, deliveries: Any, *, owner: str, last: bool = False) -> Any:
        try:
            return original(handler, deliveries, owner=owner, last=last)
        except LedgerError:  # the batch's claims may have landed: counted as done, never taken back
            return bulk.BatchResult([Step(Outcome.DUPLICATE, Action.RETURN, d.key) for d in deliveries],
                                    [d.key for d in deliveries])
    return send_batch


def _verdict_dropped_on_reschedule(original: Callable[..., Step]) -> Callable[..., Step]:
    def record_sent(self: Handler, d: Any, claim: Any, value: Any, *, reconciled: bool = False) -> Step:
        step = original(self, d, claim, value, reconciled=reconciled)
        if step.action is Action.RESCHEDULE:  # the verdict left behind: the lease decides instead
            return Step(step.outcome, step.action, step.key, error=step.error, countdown=step.countdown,
                        carry=replace(step.carry, verdict=None))
        return step
    return record_sent


@dataclass(frozen=True)
class Defect:
    name: str
    what: str
    patches: Callable[[], list[Patch]]
    #: Worlds to search (random walks, then exhaustive when given small bounds), first catch wins.
    worlds: tuple[Config, ...]


SMALL = Config(provider="keyless", intents=1, copies=2, faults=2, crashes=1, stalls=1, ticks=3, steps=60)

DEFECTS: tuple[Defect, ...] = (
    Defect("unfenced_completion", "completion without the token fence",
           lambda: [(sim_ledger.MemLedger, "_finish", _unfenced(sim_ledger.MemLedger._finish))],
           (Config(provider="smtp", copies=2, faults=1, only=("before_rcpt",), crashes=0, stalls=1, ticks=1,
                   preemptions=1, steps=60),
            Config(provider="smtp", copies=2, faults=1, crashes=0, stalls=1, ticks=1, preemptions=1, steps=60))),
    Defect("chain_marks_void", "every chain mark treated as void",
           lambda: [(m, "live_mark", lambda claim, owners=(): None) for m in (handler_mod, recovery)],
           (Config(provider="keyless", copies=1, faults=1, crashes=1, ticks=2, steps=40), SMALL)),
    Defect("no_cross_check", "no rotation cross-check",
           lambda: [(Handler, "cross_check", lambda self, d, claim: None)],
           (Config(provider="keyless", copies=2, faults=0, crashes=0, rotation=True, rotation_from=3, ticks=0,
                   preemptions=1, steps=40),
            Config(provider="keyless", copies=2, faults=0, crashes=0, rotation=True, ticks=0, preemptions=3,
                   steps=60))),
    Defect("ambiguous_released", "an ambiguous SMTP reply released instead of parked",
           lambda: [(Handler, "retry_or_park", _released_ambiguity(Handler.retry_or_park))],
           (Config(provider="smtp", copies=1, faults=1, crashes=0, ticks=1, steps=40),)),
    Defect("owner_not_carried", "the owner not carried across an outage",
           lambda: [(Delivery, "held", _no_owner_held(Delivery.held))],
           (Config(provider="keyless", copies=1, faults=6, crashes=0, ticks=3, steps=80),
            Config(provider="keyed", copies=1, faults=6, crashes=0, ticks=3, steps=80))),
    Defect("sweep_live_lease", "the sweep re-driving a claim whose lease is live",
           lambda: [(redrive, "_sweep_ledger", _sweep_ignoring_leases(redrive._sweep_ledger))],
           (Config(provider="keyed", copies=1, faults=0, crashes=0, sweeps=1, ticks=0, steps=30),)),
    Defect("provider_before_mark", "the provider called before the write-ahead mark is stored",
           lambda: [(Handler, "ahead_hook", _mark_after_send)],
           (Config(provider="keyless", copies=1, faults=0, crashes=1, ticks=1, steps=40),
            Config(provider="smtp", copies=1, faults=0, crashes=1, ticks=1, steps=40))),
    Defect("campaign_drops_lost_batch", "a campaign recipient dropped when its batch claim reply was lost",
           lambda: [(bulk, "send_batch", _drop_lost_batches(bulk.send_batch))],
           (Config(provider="keyless", intents=0, campaign=3, batch=2, faults=1, crashes=0, ticks=1, steps=60),)),
    Defect("own_mark_not_void", "a chain's own mark from an attempt that sent nothing parks it (history: "
           "the rule that a chain's own mark is void)",
           lambda: [(m, "live_mark", lambda claim, owners=(): claim.record.mark)
                    for m in (handler_mod, recovery)],
           (Config(provider="smtp", copies=1, faults=2, crashes=0, ticks=1, preemptions=0, steps=40),
            Config(provider="keyless", copies=1, faults=3, crashes=0, ticks=2, steps=60))),
    Defect("verdict_dropped", "a verdict not carried through a reschedule (history: verdicts carried "
           "through reschedules)",
           lambda: [(Handler, "record_sent", _verdict_dropped_on_reschedule(Handler.record_sent))],
           (Config(provider="keyless", copies=1, faults=5, crashes=0, ticks=2, steps=60),)),
)


@contextmanager
def planted(defect: Defect) -> Iterator[None]:
    """The library with ``defect`` in it, for the ``with`` block."""
    with patched(defect.patches()):
        yield
