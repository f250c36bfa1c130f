"""One simulated world: a virtual clock, a ledger behind a fault layer, a broker, providers, and the
actors (deliveries, campaign passes, sweeps, operators) that run the real library code in greenlets.

Each actor hands control back to the scheduler (:meth:`World.step`) at every ledger call, provider
call, publish and ack. At each step the scheduler picks one of :meth:`World.options`: let an actor
go on (its pending call landing, failing before the write, or landing with its reply lost), start
a delivery, crash an actor (a SIGKILL: its message comes back), pause one (its lease renewals
stop), hand out a copy of a running message (a visibility timeout), lose a queued message, lose
the whole store, step a key-secret rotation, act as an operator, or move the clock on. Once the
steps run out, :meth:`World.drain` lets everything finish without faults, and
:meth:`World.violations` checks the invariants.
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from greenlet import greenlet

import idemmail_celery.batch as batch
import idemmail_celery.bulk as bulk
import idemmail_celery.handler as handler_mod
import idemmail_celery.ledger.base as ledger_base
import idemmail_celery.recovery as recovery
import idemmail_celery.redrive as redrive
import idemmail_celery.steps as steps
from idemmail_celery._common import backoff
from idemmail_celery.chain import (
    HOP_HEADER,
    KEY_HEADER,
    OWNER_HEADER,
    VERDICT_HEADER,
    ChainState,
    next_headers,
    owners_of,
)
from idemmail_celery.errors import AmbiguousSendError, IdemmailError, PermanentSendError, TransientSendError
from idemmail_celery.handler import Action, Delivery, Handler, Outcome, Policy, Step, owned_by
from idemmail_celery.keys import IntentKeyBuilder, Payload
from idemmail_celery.ledger import Ledger, Record, State
from idemmail_celery.ledger.base import Mark, new_owner
from idemmail_celery.mail import TASK_NAME as SEND_EMAIL
from idemmail_celery.providers.base import about_to_send

from .ledger import AFTER, BEFORE, OK, FaultLedger, MemLedger

START = 1_000_000.0
LEASE = 30.0
#: The broker's visibility timeout, the sweep's quiet period, the keyed provider's de-duplication window.
VISIBILITY = 3600.0
SWEEP_AFTER = 2 * VISIBILITY
KEY_WINDOW = 24 * 3600.0
CAMPAIGN_ID = "camp"
BASE = {"subject": "s", "text": "t", "event_id": CAMPAIGN_ID}

#: What a provider call may come to besides success, per provider kind.
PROVIDER_FAULTS = {
    "keyed": ("transient", "ambiguous_sent", "ambiguous_unsent", "permanent"),
    "keyless": ("transient", "ambiguous_sent", "ambiguous_unsent", "permanent"),
    # SMTP: refused before RCPT (nothing sent, no mark), the connection dropped after DATA was accepted
    # (marked, nothing sent), the final reply lost after the message (marked, maybe sent), rejected.
    "smtp": ("before_rcpt", "after_data", "reply_lost_sent", "reply_lost_unsent", "rejected"),
}
LEDGER_FAULTS = (BEFORE, AFTER)



def _claim_mark(record: Record) -> Mark | None:
    """The write-ahead mark of a ``claimed`` record (a released one's is for its next claimer), or None."""
    return record.mark if record.state is State.CLAIMED else None

class Killed(BaseException):
    """Thrown into a crashed actor: it unwinds, and nothing it does from here on reaches the world."""


class PassAgain(Exception):
    """A campaign pass publishes its next pass (the republisher's ``apply_async``; the world publishes it)."""

    def __init__(self, countdown: float, headers: dict[str, Any]) -> None:
        super().__init__("campaign pass again")
        self.countdown, self.headers = float(countdown or 0.0), headers


@dataclass(frozen=True)
class Config:
    """The bounds of one world."""

    provider: str = "keyless"   #: keyed | keyless | smtp
    intents: int = 1            #: single sends, each enqueued ``copies`` times by the caller
    copies: int = 2
    campaign: int = 0           #: recipients of one campaign (0: none), enqueued ``campaign_copies`` times
    campaign_copies: int = 1
    overlap: bool = False       #: the campaign's first recipient is also a single send's intent
    batch: int = 5
    faults: int = 1             #: ledger and provider faults
    crashes: int = 1
    stalls: int = 0
    vt_copies: int = 0
    lost: int = 0               #: queued messages the broker loses (the sweep re-drives them)
    losses: int = 0             #: whole-store losses
    rotation: bool = False
    rotation_from: int = 0      #: the rotation's step at the start (3: its second step being deployed)
    only: tuple[str, ...] = ()  #: the fault kinds offered (empty: all)
    operator: int = 0           #: operator actions (truthful resolve of a review, forget)
    forget_live: bool = False   #: may the operator forget a claim still held (else only final records)
    sweeps: int = 0             #: sweeps during the schedule (the drain sweeps when a message was lost)
    ticks: int = 2              #: clock steps (past a lease) during the schedule
    preemptions: int = 2        #: switches away from a running actor that could have gone on
    workers: int = 3
    steps: int = 60
    ledger: str = "memory"      #: memory | sqlite


@dataclass
class Message:
    id: int
    kind: str                   #: send | campaign
    task_id: str
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    retries: int = 0
    eta: float = START
    enqueued_at: float = START


@dataclass
class Actor:
    id: int
    kind: str                   #: send | campaign | sweep | operator
    msg: Message | None
    glet: Any = None
    pending: tuple[str, str] | None = None
    stalled: bool = False
    dead: bool = False
    held: dict[tuple[str, int], float] = field(default_factory=dict)
    phase: int = 0
    builder: int = 0
    marked: set[int] = field(default_factory=set)  # intents it wrote a write-ahead mark for
    claimed: set[str] = field(default_factory=set)  # keys it asked to claim


class SimKeeper:
    """The lease keeper, as scheduler events: claims held by a live, unpaused actor are renewed when
    the clock steps; a paused actor's are not. A claim dropped still held and marked (its release refused)
    is left behind by its holder, alive or not (:meth:`World.left_behind`)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def hold(self, ledger: Ledger, key: str, token: int, lease_seconds: float) -> None:
        actor = self.world.current
        if actor is not None:
            actor.held[(key, token)] = lease_seconds

    def drop(self, ledger: Ledger, key: str, token: int) -> None:
        actor = self.world.current
        if actor is not None:
            actor.held.pop((key, token), None)
        self.world.dropped(key, token)


class Effect:
    """The side effect the handler is lent: the world's provider under one of its three kinds."""

    def __init__(self, world: World) -> None:
        self.world = world

    def check(self, payload: Payload) -> None:
        return None

    def perform(self, payload: Payload, key: str) -> Any:
        return self.world.provider_send(payload, key)

    def carries_key(self) -> bool:
        return self.world.cfg.provider == "keyed"

    def writes_ahead(self) -> bool:
        return self.world.cfg.provider != "keyed"

    def reconcile(self, key: str, payload: Payload) -> Any | None:
        return None  # SMTP and the keyless APIs cannot be searched: review is the safe answer

    def report(self, outcome: Outcome, key: str, **fields: Any) -> None:
        return None


class Sender:
    """What ``_send_campaign`` asks of ``send_email``: its key builder, ledger, policy and side effect."""

    def __init__(self, world: World, builder: IntentKeyBuilder) -> None:
        self.world, self.key_builder, self.ledger = world, builder, world.ledger
        self.idem_settings = types.SimpleNamespace(campaign_pass_seconds=world.pass_seconds)

    def check(self, payload: Payload) -> None:
        return None

    def check_call(self, args: Any, kwargs: dict[str, Any]) -> None:
        return None

    def deliver(self, kwargs: dict[str, Any], key: str) -> Any:
        return self.world.provider_send(Payload([], dict(kwargs)), key)

    def carries_key(self) -> bool:
        return self.world.effect.carries_key()

    def writes_ahead(self) -> bool:
        return self.world.effect.writes_ahead()

    def reconcile(self, key: str, payload: Payload) -> Any | None:
        return None

    def policy_or_default(self) -> Policy:
        return self.world.policy

    def ensure_announced(self) -> None:
        return None  # no roster here: the simulated workers claim at once

    def wait_as_received(self, exc: BaseException, running: Any = None) -> None:
        raise AssertionError(f"the simulated campaign cannot read its headers: {exc}")

    wait_for_key_secret = wait_as_received


class CampaignTask:
    """The campaign task as ``_send_campaign`` and the republisher see it (``self``): its request, app and
    ``signature_from_request``, whose ``apply_async`` hands the next pass to the world."""

    name = bulk.CAMPAIGN_TASK

    def __init__(self, msg: Message, sender: Sender) -> None:
        self.app = types.SimpleNamespace(tasks={SEND_EMAIL: sender})
        self.request = types.SimpleNamespace(id=msg.task_id, retries=msg.retries, headers=dict(msg.headers),
                                             args=[], kwargs=msg.kwargs, is_eager=False)

    def signature_from_request(self, request: Any, *, countdown: float = 0.0, headers: Any = None,
                               **_: Any) -> NextPass:
        return NextPass(PassAgain(countdown, headers or {}))

    def update_state(self, **_: Any) -> None:
        return None


@dataclass(frozen=True)
class NextPass:
    """The next pass's message as the republisher signs it: publishing it is the world's."""

    again: PassAgain

    def apply_async(self) -> None:
        raise self.again


class SweepTarget:
    """``send_email`` as the re-drive sweep sees it: a republish from the stored first payload."""

    def __init__(self, world: World) -> None:
        self.world = world

    def key_headers(self, key: str, payload: Payload) -> dict[str, Any]:
        return {KEY_HEADER: key}

    def apply_async(self, args: Any, kwargs: dict[str, Any], headers: dict[str, Any]) -> None:
        self.world.swept(dict(kwargs), dict(headers))


def _signature(to: str, subject: str = "", text: str = "", event_id: str = "") -> None:
    """The arguments every simulated send is made of (``send_email``'s key rule reads them)."""


def builders() -> tuple[IntentKeyBuilder, IntentKeyBuilder, IntentKeyBuilder]:
    """Key builders before a key-secret rotation (the old secret), after its first step (the new one
    added, the old one still first) and after its second (the new one first, the old one kept)."""
    from idemmail_celery.mail import email_intent

    base = IntentKeyBuilder(task_name=SEND_EMAIL, signature=inspect.signature(_signature), spec=email_intent,
                            address_fields=frozenset({"to"}), secret="old")
    return base, replace(base, secret=["old", "new"]), replace(base, secret=["new", "old"])


_BUILDERS: tuple[IntentKeyBuilder, IntentKeyBuilder, IntentKeyBuilder] | None = None
_KEYS: dict[tuple[int, str], tuple[str, tuple[str, ...]]] = {}


def _keys(index: int, builder: IntentKeyBuilder, payload: Payload) -> tuple[str, tuple[str, ...]]:
    """The key and older keys a builder derives for a payload (the same every schedule: worked out once)."""
    name = (index, payload.to_json())
    found = _KEYS.get(name)
    if found is None:
        found = _KEYS[name] = (builder.derive(payload), tuple(builder.older_keys(payload)))
    return found


class World:
    """Everything one schedule runs against; see the module docstring."""

    def __init__(self, cfg: Config, *, sqlite_url: str | None = None, keep_log: bool = False) -> None:
        global _BUILDERS
        if _BUILDERS is None:
            _BUILDERS = builders()
        self.cfg = cfg
        self.now = START
        self.pass_seconds = 2 * LEASE
        if cfg.ledger == "sqlite":
            from idemmail_celery.ledger.sql import SQLLedger

            self.store: Ledger = SQLLedger(sqlite_url or "sqlite:///:memory:")
        else:
            self.store = MemLedger(lambda: self.now)
        self.ledger = FaultLedger(self.store, self._ledger_point, self)
        self.policy = Policy(lease_seconds=LEASE, retry_jitter=False, hop_ttl_seconds=VISIBILITY)
        self.effect = Effect(self)
        self.handlers = [Handler(self.ledger, b, self.policy, self.effect) for b in _BUILDERS]
        self.budget = {"faults": cfg.faults, "crashes": cfg.crashes, "stalls": cfg.stalls, "vt": cfg.vt_copies,
                       "lost": cfg.lost, "losses": cfg.losses, "operator": cfg.operator, "sweeps": cfg.sweeps,
                       "ticks": cfg.ticks, "preempt": cfg.preemptions}
        # The rotation: 0, 2 and 4 are its settled steps (builders 0, 1, 2); 1 and 3 are deploys of the next
        # step, workers of both steps side by side.
        self.rotation = cfg.rotation_from
        self.store_lost = False
        self.lost_messages = 0
        self.queue: list[Message] = []
        self.actors: list[Actor] = []
        self.current: Actor | None = None
        self.last: int | None = None
        self.ids = itertools.count(1)
        self.main: Any = None
        # What happened, for the invariants.
        self.addresses: list[str] = []
        self.intent_of: dict[str, int] = {}       # every key and address of an intent -> its number
        self.keys_of: dict[int, set[str]] = {}
        self.effects: dict[int, list[float]] = {}  # messages the provider accepted, per intent
        self.attempts: dict[int, int] = {}         # provider calls begun, per intent
        self.known: set[int] = set()               # intents whose send a holder saw succeed
        self.orphaned: set[int] = set()            # ...by a holder that then crashed or paused
        self.left_owners: set[str] = set()         # owners that left a marked claim behind
        self.mark_owner: dict[tuple[str, Any], str] = {}  # (key, token) -> the owner that wrote the mark
        self.unknowable: set[int] = set()          # intents parked over such a mark by a delivery without it
        self.told: list[tuple[int, Step]] = []     # final answers given to callers
        self.before_loss: set[int] = set()         # intents final in a store that was then lost
        self.touched_by_loss: set[int] = set()     # intents with a record or a send when the store was lost
        self.rejected: set[int] = set()            # intents the provider refused for good
        self.key_seen: dict[str, float] = {}       # the keyed provider's de-duplication window
        self.redrive_live: list[str] = []          # keys the sweep republished while their lease was live
        self.campaign_results: list[Any] = []
        self.errors: list[str] = []
        self.steps = 0
        self.keep_log = keep_log
        self.log: list[str] = []
        self._setup()

    # -- set-up --

    def _setup(self) -> None:
        cfg = self.cfg
        n_single = cfg.intents
        n_campaign = cfg.campaign
        for i in range(n_single + n_campaign):
            self.addresses.append(f"r{i}@example.com")
        assert _BUILDERS is not None
        for i, to in enumerate(self.addresses):
            self.intent_of[to] = i
            payload = self.payload(to)
            keys = {b.derive(payload) for b in _BUILDERS}
            self.keys_of[i] = keys
            for k in keys:
                self.intent_of[k] = i
        for i in range(n_single):
            for c in range(cfg.copies):
                self.publish("send", f"t{i}-{c}", {"to": self.addresses[i], **BASE}, {})
        if n_campaign:
            first = 0 if cfg.overlap else n_single
            people = self.addresses[first:n_single + n_campaign]
            for c in range(cfg.campaign_copies):
                self.publish("campaign", f"c-{c}", {"campaign_id": CAMPAIGN_ID, "recipients": people,
                                                    "subject": "s", "text": "t", "batch_size": cfg.batch}, {})

    @staticmethod
    def payload(to: str) -> Payload:
        return Payload([], {"to": to, **BASE})

    def publish(self, kind: str, task_id: str, kwargs: dict[str, Any], headers: dict[str, Any], *,
                retries: int = 0, countdown: float = 0.0, enqueued_at: float | None = None) -> Message:
        msg = Message(next(self.ids), kind, task_id, kwargs, headers, retries, self.now + max(countdown, 0.0),
                      self.now if enqueued_at is None else enqueued_at)
        self.queue.append(msg)
        return msg

    # -- inside actors --

    def point(self, op: str, key: str) -> str:
        """A scheduling point: hand control to the scheduler, which answers how the call goes."""
        actor = self.current
        if actor is None:
            return OK  # the scheduler's own calls (the drain's checks)
        if actor.dead:
            raise Killed()
        actor.pending = (op, key)
        how: str = self.main.switch()
        if actor.dead:
            raise Killed()
        return how

    def _ledger_point(self, op: str, key: str) -> str:
        if op in ("claim", "claim_many") and self.current is not None:
            self.current.claimed.update(key.split(","))
        return self.point(f"ledger.{op}", key)

    def note_mark(self, key: str, token: int) -> None:
        record = self.store.get(key)
        if record is not None:
            self.mark_owner[(key, token)] = record.owner
        intent = self.intent_of.get(key, -1)
        if self.current is not None:
            self.current.marked.add(intent)

    def left_behind(self, actor: Actor) -> None:
        """``actor`` ended, and may leave a marked claim behind (a release that failed): a delivery that did not
        carry its owner and finds it once the lease runs out cannot tell it from a holder that died mid-send."""
        for key in actor.claimed:
            record = self.store.get(key)
            if record is not None and _claim_mark(record) is not None:
                self.left_owners.add(record.owner)

    def dropped(self, key: str, token: int) -> None:
        """A holder stopped renewing the claim ``(key, token)``: settled, or left behind as :meth:`left_behind`
        says, though the holder goes on (a campaign pass whose release of one recipient failed sends the next
        ones; nobody renews that claim until its next pass takes it back)."""
        record = self.store.get(key)
        if record is not None and record.state is State.CLAIMED and record.token == token \
                and _claim_mark(record) is not None:
            self.left_owners.add(record.owner)

    def parking(self, key: str) -> None:
        """A delivery parks ``key``: a mark on it from a holder that left it behind, whose owner this delivery
        did not carry, is a possible send as far as it can know."""
        record = self.store.get(key)
        mark = _claim_mark(record) if record is not None else None
        actor = self.current
        if mark is None or actor is None or actor.msg is None:
            return
        writer = self.mark_owner.get((key, mark.token))
        carried = owners_of(actor.msg.headers.get(OWNER_HEADER))
        if writer in self.left_owners and not owned_by(writer, carried):
            self.unknowable.add(self.intent_of.get(key, -1))

    def orphan(self, actor: Actor) -> None:
        """``actor`` crashed or paused: a mark it wrote, or one on a claim it held (an earlier holder's, which
        it had judged void), may now be all anyone knows of a send."""
        self.orphaned |= actor.marked
        for key in actor.claimed:
            record = self.store.get(key)
            if record is not None and _claim_mark(record) is not None:
                self.orphaned.add(self.intent_of.get(key, -1))

    def refused_before(self, intent: int) -> None:
        """A message the provider refused for good is refused again, every time."""
        if intent in self.rejected:
            raise PermanentSendError("550 refused again", reason="rejected")

    def consistent(self, intent: int, how: str) -> str:
        """A provider that accepted a message does not refuse the same one for good later."""
        return OK if how in ("permanent", "rejected") and self.effects.get(intent) else how

    def provider_send(self, payload: Payload, key: str) -> Any:
        """The provider: keyed (de-duplicates on the key within its window), keyless HTTP, or SMTP."""
        kind = self.cfg.provider
        intent = self.intent_of[payload.kwargs["to"]]
        if kind == "smtp":
            how = self.consistent(intent, self.point("provider.rcpt", key))
            self.refused_before(intent)
            if how == "before_rcpt":
                raise TransientSendError("421 try again later", reason="smtp_busy")
            if how == "rejected":
                self.rejected.add(intent)
                raise PermanentSendError("550 no such user", reason="rejected")
            about_to_send("message")  # DATA accepted: the write-ahead mark, then the message
            how = self.point("provider.message", key)
            if how == "after_data":
                raise TransientSendError("connection dropped before the message", reason="smtp_dropped")
        else:
            if kind == "keyless":
                about_to_send("request")
            how = self.consistent(intent, self.point("provider.send", key))
            self.refused_before(intent)
            seen = self.key_seen.get(key) if kind == "keyed" else None
            if seen is not None and self.now - seen <= KEY_WINDOW and how in ("transient", "permanent"):
                how = OK  # a key the provider has seen: it answers with the first response
            if how == "transient":
                raise TransientSendError("503 unavailable", reason="unavailable")
            if how == "permanent":
                self.rejected.add(intent)
                raise PermanentSendError("422 invalid", reason="rejected")
        self.attempts[intent] = self.attempts.get(intent, 0) + 1
        if how in ("ambiguous_unsent", "reply_lost_unsent"):
            raise AmbiguousSendError("the reply never came", reason="timeout")
        accepted = True
        if kind == "keyed":
            seen = self.key_seen.get(key)
            accepted = seen is None or self.now - seen > KEY_WINDOW
            if accepted:
                self.key_seen[key] = self.now
        if accepted:
            self.effects.setdefault(intent, []).append(self.now)
        if how in ("ambiguous_sent", "reply_lost_sent"):
            raise AmbiguousSendError("the reply never came", reason="timeout")
        self.point("provider.reply", key)  # a crash here: sent, and nobody heard
        return {"message_id": f"m-{intent}-{len(self.effects.get(intent, ()))}"}

    # -- actors' bodies --

    def run_send(self, actor: Actor) -> None:
        msg = actor.msg
        assert msg is not None
        h = msg.headers
        carried = h.get(KEY_HEADER) if msg.task_id.startswith("sweep") else None
        payload = Payload([], dict(msg.kwargs))
        handler = self.handlers[actor.builder]
        older: tuple[str, ...] = ()
        if carried:
            key = str(carried)
        else:
            key, older = _keys(actor.builder, handler.builder, payload)
        chain = ChainState.from_headers(h)
        owner = new_owner(msg.task_id)
        d = Delivery(key=key, task_name=SEND_EMAIL, payload=payload, attempt_id=msg.task_id,
                     inflight=chain.inflight, outage=chain.outage, resume_owners=chain.owners, verdict=chain.verdict,
                     older_keys=tuple(older), retries=msg.retries, max_retries=3, enqueued_at=msg.enqueued_at,
                     hop=chain.hop or msg.task_id, owner=owner)
        step = handler.handle(d)
        intent = self.intent_of[msg.kwargs["to"]]
        if step.action in (Action.RETURN, Action.RAISE):
            self.told.append((intent, step))
            if step.outcome is Outcome.SENT:
                self.known.add(intent)
        if step.action in (Action.RETRY, Action.RESCHEDULE):
            headers = next_headers(h, step.carry, keep=step.action is Action.RESCHEDULE)
            headers[HOP_HEADER] = step.carry.hop or f"hop{next(self.ids)}"  # as Republisher.split
            self.point("broker.publish", key)
            self.publish("send", msg.task_id, msg.kwargs, headers, countdown=step.countdown,
                         retries=msg.retries + (step.action is Action.RETRY), enqueued_at=msg.enqueued_at)
            self.knows(headers.get(VERDICT_HEADER), intent)
            handler.published(step)
        self.point("broker.ack", key)

    def knows(self, verdict: Any, intent: int) -> None:
        """A "sent" verdict left in a published message: the chain knows the intent was sent."""
        if isinstance(verdict, dict) and verdict.get("state") == State.SENT.value:
            self.known.add(intent)

    def run_campaign(self, actor: Actor) -> None:
        msg = actor.msg
        assert msg is not None
        assert _BUILDERS is not None
        sender = Sender(self, self.handlers[actor.builder].builder)
        task = CampaignTask(msg, sender)
        try:
            result = bulk._send_campaign(task, **msg.kwargs)
        except PassAgain as again:
            self.point("broker.publish", CAMPAIGN_ID)
            self.publish("campaign", msg.task_id, msg.kwargs, again.headers, countdown=again.countdown,
                         retries=msg.retries + 1, enqueued_at=msg.enqueued_at)
            verdicts = again.headers.get(VERDICT_HEADER)
            for key, verdict in (verdicts.items() if isinstance(verdicts, dict) else ()):
                self.knows(verdict, self.intent_of.get(key, -1))
        except Exception as exc:  # the campaign failed (past a budget): acknowledged, its result an error
            self.campaign_results.append(exc)
        else:
            self.campaign_results.append(result)
        self.point("broker.ack", CAMPAIGN_ID)

    def run_sweep(self, actor: Actor) -> None:
        redrive._sweep_ledger(self.ledger, {SEND_EMAIL: SweepTarget(self)}, SWEEP_AFTER,  # type: ignore[dict-item]
                              self.now, redrive.SWEEP_LIMIT)

    def swept(self, kwargs: dict[str, Any], headers: dict[str, Any]) -> None:
        record = self.store.get(str(headers[KEY_HEADER]))
        if record is not None and record.state is State.CLAIMED and (record.lease_expires_at or 0) > self.now:
            self.redrive_live.append(str(headers[KEY_HEADER]))
        self.publish("send", f"sweep{next(self.ids)}", kwargs, headers)

    def run_operator(self, actor: Actor) -> None:
        """A careful operator: a parked intent resolved as the provider's own log says once nothing else runs
        (a paused holder may still send), or a record forgotten."""
        settled = len(self.actors) == 1
        for record in list(self.ledger.iter_records(State.REVIEW)) if settled else ():
            intent = self.intent_of.get(record.key, -1)
            if self.effects.get(intent):
                self.ledger.resolve(record.key, State.SENT, result={"message_id": "found-by-operator"})
            else:
                self.ledger.resolve(record.key, State.FAILED, note="not sent: the provider has no trace")
            return
        for record in list(self.ledger.iter_records()):
            if record.state.is_final or self.cfg.forget_live:
                self.ledger.forget(record.key)
                return

    def phase_of(self, actor: Actor) -> int:
        """The key builder (0, 1, 2) the worker an actor runs on has: during a deploy, either step's."""
        return self.rotation // 2 + (actor.phase if self.rotation % 2 else 0)

    def may_rotate(self) -> bool:
        """The next step of a rotation is deployed once no worker of the step before the current one runs
        (a deploy waits for its old workers' tasks: a warm shutdown)."""
        floor = (self.rotation + 1) // 2
        return self.rotation < 4 and all(a.builder >= floor for a in self.actors)

    # -- the scheduler's side --

    def options(self) -> list[tuple[Any, ...]]:
        """What may happen next, progress first (index 0 goes on with the actor that ran last)."""
        b = self.budget
        runnable = [a for a in self.actors if not a.stalled]
        runnable.sort(key=lambda a: a.id != self.last)
        opts: list[tuple[Any, ...]] = []
        current_goes_on = bool(runnable) and runnable[0].id == self.last
        for n, a in enumerate(runnable):
            if n == 0 or not current_goes_on or b["preempt"] > 0:
                opts.append(("run", a.id, OK))
        due = [m for m in self.queue if m.eta <= self.now]
        if due and len(self.actors) < self.cfg.workers and (not current_goes_on or b["preempt"] > 0):
            opts.append(("deliver", due[0].id))  # one queue, handed out in order
        for a in runnable[:1] if current_goes_on and b["preempt"] <= 0 else runnable:
            op = a.pending[0] if a.pending else ""
            if b["faults"] > 0:
                kinds: tuple[str, ...] = ()
                if op.startswith("ledger."):
                    kinds = LEDGER_FAULTS
                elif op in ("provider.send", "provider.rcpt"):
                    kinds = tuple(f for f in PROVIDER_FAULTS[self.cfg.provider]
                                  if self.cfg.provider != "smtp" or f in ("before_rcpt", "rejected"))
                elif op == "provider.message":
                    kinds = PROVIDER_FAULTS["smtp"][1:4]
                opts += [("run", a.id, f) for f in kinds if not self.cfg.only or f in self.cfg.only]
            if a.kind in ("send", "campaign"):
                if b["crashes"] > 0:
                    opts.append(("crash", a.id))
                if b["stalls"] > 0 and a.held:
                    opts.append(("stall", a.id))
                if b["vt"] > 0:
                    opts.append(("vt_copy", a.id))
        if b["lost"] > 0:
            opts += [("lose", m.id) for m in self.queue[:2]]
        if b["losses"] > 0 and not self.store_lost:
            opts.append(("store_loss",))
        if self.store_lost:
            opts.append(("ack_loss",))
        if self.cfg.rotation and self.may_rotate():
            opts.append(("rotate",))
        if b["operator"] > 0 and len(self.actors) < self.cfg.workers:
            opts.append(("operator",))
        if b["sweeps"] > 0 and len(self.actors) < self.cfg.workers:
            opts.append(("sweep",))
        if b["ticks"] > 0 and (self.actors or self.queue) and self.time_matters():
            opts.append(("tick",))
        return opts

    def time_matters(self) -> bool:
        """May the clock take a step now, and can it change anything? Only while every actor that is not
        paused waits in a renewed section (a slow provider: its lease is kept), and only when some claim has
        nobody renewing it (a paused, crashed or uninformed holder) or a campaign pass may run out of time."""
        live = [a for a in self.actors if not a.stalled]
        if any(not a.held for a in live):
            return False  # an actor between two steps takes no time
        if len(live) < len(self.actors) or any(a.kind == "campaign" for a in self.actors):
            return True
        renewed = {k for a in live for k in a.held}
        return any(r.state is State.CLAIMED and (r.key, r.token) not in renewed and r.key in self.intent_of
                   for r in self.store.iter_records(State.CLAIMED))

    def step(self, opt: tuple[Any, ...]) -> None:
        """Carry out one option (see :meth:`options`)."""
        self.steps += 1
        self.now += 0.001  # every step takes a little time: nothing two steps do happens at one instant
        if self.keep_log:
            where = ""
            if opt[0] in ("run", "crash", "stall", "vt_copy"):
                actor = self._actor(opt[1])
                task = actor.msg.task_id if actor.msg else ""
                where = f" at {actor.pending[0] if actor.pending else 'start'} ({actor.kind} {task})"
            self.log.append(" ".join(str(x) for x in opt) + where + f" t+{self.now - START:.0f}")
        kind, b = opt[0], self.budget
        if kind == "run":
            actor = self._actor(opt[1])
            if actor.id != self.last and self.last in {a.id for a in self.actors if not a.stalled}:
                b["preempt"] -= 1
            if opt[2] != OK:
                b["faults"] -= 1
            self._resume(actor, opt[2])
        elif kind == "deliver":
            msg = next(m for m in self.queue if m.id == opt[1])
            self.queue.remove(msg)
            self.start(msg.kind, msg)
        elif kind == "crash":
            b["crashes"] -= 1
            actor = self._actor(opt[1])
            self.kill(actor)
            assert actor.msg is not None
            self.queue.append(replace(actor.msg, id=next(self.ids), eta=self.now))  # the broker hands it out again
        elif kind == "stall":
            b["stalls"] -= 1
            self._actor(opt[1]).stalled = True
            self.orphan(self._actor(opt[1]))
        elif kind == "vt_copy":
            b["vt"] -= 1
            running = self._actor(opt[1]).msg
            assert running is not None
            self.queue.append(replace(running, id=next(self.ids), eta=self.now))
        elif kind == "lose":
            b["lost"] -= 1
            self.lost_messages += 1
            self.queue = [m for m in self.queue if m.id != opt[1]]
        elif kind == "store_loss":
            b["losses"] -= 1
            self.lose_store()
        elif kind == "ack_loss":
            self.store_lost = False
            self.store.recovered_at = self.now
        elif kind == "rotate":
            self.rotation += 1
        elif kind == "operator":
            b["operator"] -= 1
            self.start("operator", None)
        elif kind == "sweep":
            b["sweeps"] -= 1
            self.start("sweep", None)
        elif kind == "tick":
            b["ticks"] -= 1
            self.tick(LEASE + 1.0)
        else:  # pragma: no cover - options() makes only the kinds above
            raise ValueError(opt)

    def _actor(self, actor_id: int) -> Actor:
        return next(a for a in self.actors if a.id == actor_id)

    def start(self, kind: str, msg: Message | None) -> None:
        actor = Actor(next(self.ids), kind, msg, phase=len(self.actors) % 2)
        actor.builder = self.phase_of(actor)
        body = {"send": self.run_send, "campaign": self.run_campaign, "sweep": self.run_sweep,
                "operator": self.run_operator}[kind]
        actor.glet = greenlet(lambda _how: self._body(body, actor))
        self.actors.append(actor)
        self._resume(actor, OK)

    def _body(self, body: Callable[[Actor], None], actor: Actor) -> None:
        try:
            body(actor)
        except Killed:
            raise
        except IdemmailError as exc:
            if actor.kind in ("send", "campaign"):  # a defect: the task fails and its message is acknowledged
                self.errors.append(f"{actor.kind} raised {type(exc).__name__}: {exc}")
            # A sweep or an operator's command that met an outage fails; beat or the operator runs it again.
        except Exception as exc:  # a defect: the task fails and its message is acknowledged
            self.errors.append(f"{actor.kind} raised {type(exc).__name__}: {exc}")

    def _resume(self, actor: Actor, how: str) -> None:
        self.current, self.last = actor, actor.id
        try:
            actor.glet.switch(how)
        finally:
            self.current = None
        if actor.glet.dead:
            self.actors.remove(actor)
            self.left_behind(actor)

    def kill(self, actor: Actor) -> None:
        self.orphan(actor)
        actor.dead = True
        self.current = actor
        try:
            actor.glet.throw(Killed())
        except Killed:
            pass
        finally:
            self.current = None
        actor.held.clear()
        if actor in self.actors:
            self.actors.remove(actor)

    def tick(self, seconds: float) -> None:
        """Move the clock on; the keeper renews the claims of live, unpaused actors first (every third of
        a lease, so a renewal before each third is the same), and paused ones wake up."""
        end = self.now + seconds
        while self.now < end:
            for a in self.actors:
                if not a.stalled:
                    for (key, token), lease in list(a.held.items()):
                        if not self.store_lost:
                            self.store.renew(key, token, lease)
            self.now = min(end, self.now + LEASE / 3)
        for a in self.actors:
            a.stalled = False

    def lose_store(self) -> None:
        for i, keys in self.keys_of.items():
            if self.effects.get(i) or any(self.store.get(k) is not None for k in keys):
                self.touched_by_loss.add(i)
            if any((r := self.store.get(k)) is not None and r.state.is_final for k in keys):
                self.before_loss.add(i)
        assert isinstance(self.store, MemLedger), "only the in-memory store is lost"
        self.store.lose_everything()
        self.store_lost = True

    # -- the drain and the invariants --

    def quiet(self) -> bool:
        return not self.actors and not self.queue

    def drain(self, max_steps: int = 3000) -> bool:
        """Let everything finish, without faults: run actors, deliver due messages, wake paused ones,
        acknowledge a store loss, move the clock to the next countdown; when a message was lost, sweep.
        False: it did not settle within ``max_steps``."""
        for k in self.budget:
            if k != "preempt":
                self.budget[k] = 0
        self.budget["preempt"] = 10**9
        swept = False
        for _ in range(max_steps):
            if self.store_lost:
                self.step(("ack_loss",))
                continue
            opts = [o for o in self.options() if o[0] in ("run", "deliver")]
            if opts:
                self.step(opts[0])
                continue
            if any(a.stalled for a in self.actors):
                self.tick(LEASE + 1.0)
                continue
            if self.queue:
                self.tick(max(min(m.eta for m in self.queue) - self.now, 0.0) + 0.001)
                continue
            if self.actors:  # pragma: no cover - every actor is runnable once none is paused
                return False
            if self.lost_messages and not swept and self.stranded():
                swept = True
                self.tick(SWEEP_AFTER + LEASE)
                self.step(("sweep",))
                continue
            return True
        return False

    def stranded(self) -> list[str]:
        return [r.key for r in self.store.iter_records()
                if r.state in (State.CLAIMED, State.RELEASED) and r.key in self.intent_of]

    def record_of(self, intent: int) -> Record | None:
        """The intent's record under any of its keys (a final one first)."""
        found = [r for k in sorted(self.keys_of[intent]) if (r := self.store.get(k)) is not None]
        final = [r for r in found if r.state.is_final]
        return (final or found)[0] if found else None

    def violations(self) -> list[str]:
        """Every invariant broken at this quiescent state (empty: none)."""
        out: list[str] = []
        keyed = self.cfg.provider == "keyed"
        for i in range(len(self.addresses)):
            r = self.record_of(i)
            sent = len(self.effects.get(i, ()))
            state = r.state if r is not None else None
            if sent > 1 and (keyed or state is not State.REVIEW):
                out.append(f"intent {i} reached the provider {sent} times (record: {state and state.value})")
            if r is None:
                if i not in self.before_loss:
                    out.append(f"intent {i} was dropped: no record, and it was never recorded before a loss")
                continue
            if not state or not state.is_final:
                out.append(f"intent {i} ended {state and state.value} with nobody coming back")
            reason = (r.error or {}).get("reason")
            lost = reason == "ledger_lost" and self.store.recovered_at is not None
            poison = reason == "reclaim_limit" and self.budget["crashes"] < self.cfg.crashes
            # May have been sent: the provider was called, or a holder that had marked died or paused.
            # ...or the parker met a mark a holder left behind, without carrying that holder's owner.
            if state is State.REVIEW and not self.attempts.get(i) and i not in self.orphaned and not lost \
                    and not poison and i not in self.unknowable:
                out.append(f"intent {i} parked for review though no send could have happened "
                           f"({(r.error or {}).get('reason')})")
            if state is State.SENT and not sent:
                out.append(f"intent {i} recorded sent, never sent")
            if i in self.touched_by_loss:  # what the lost store knew, nobody knows: parked, by design
                continue
            if state is State.FAILED and sent:
                out.append(f"intent {i} recorded failed, yet it was sent")
            if i in self.known and state is not State.SENT:
                out.append(f"intent {i} was seen sent by its holder, yet ended {state and state.value}")
        for i, step in self.told:
            r = self.record_of(i)
            state = r.state if r is not None else None
            if i in self.touched_by_loss:
                continue
            if step.action is Action.RETURN and state is not State.SENT:
                out.append(f"intent {i}: a caller was told {step.outcome.value}, the record says "
                           f"{state and state.value}")
            elif step.action is Action.RAISE and step.outcome in (Outcome.FAILED, Outcome.DUPLICATE) \
                    and isinstance(step.error, PermanentSendError) and state is State.SENT:
                out.append(f"intent {i}: a caller was told failed, the record says {state and state.value}")
        out += [f"a {e}" for e in self.errors]
        if self.redrive_live:
            out.append(f"the sweep re-drove a claim whose lease was live ({len(self.redrive_live)})")
        return sorted(set(out))


@contextmanager
def installed(world_clock: Callable[[], World | None]) -> Iterator[None]:
    """Put the simulator's clock, keeper and jitter-free backoff in the library for the ``with`` block.

    ``world_clock`` returns the world whose clock and keeper apply (one world runs at a time)."""

    def now() -> float:
        w = world_clock()
        return w.now if w is not None else START

    def sleep(seconds: float) -> None:
        w = world_clock()
        if w is not None:
            w.now += seconds

    fake_time = types.SimpleNamespace(time=now, sleep=sleep, monotonic=now, perf_counter=now)

    class Keeper:
        def hold(self, *a: Any) -> None:
            w = world_clock()
            if w is not None:
                SimKeeper(w).hold(*a)

        def drop(self, *a: Any) -> None:
            w = world_clock()
            if w is not None:
                SimKeeper(w).drop(*a)

    def steady(attempt: int, base: float, cap: float, *, jitter: bool = True) -> float:
        return backoff(attempt, base, cap, jitter=False)

    class Silent:
        @staticmethod
        def report(*a: Any, **k: Any) -> None:
            return None

    import idemmail_celery.ledger.sql.connection as sql_connection
    import idemmail_celery.ledger.sql.store as sql_store

    patches: list[tuple[Any, str, Any]] = [
        (handler_mod, "time", fake_time), (recovery, "time", fake_time), (steps, "time", fake_time),
        (ledger_base, "time", fake_time), (bulk, "time", fake_time),
        (redrive, "time", fake_time), (sql_store, "time", fake_time), (sql_connection, "time", fake_time),
        (handler_mod, "keeper", Keeper()),
        (batch, "keeper", Keeper()), (handler_mod, "backoff", steady), (bulk, "backoff", steady),
        (bulk, "outcomes", Silent), (bulk, "transport_visibility_timeout", lambda app: VISIBILITY),
    ]
    with patched(patches):
        yield


@contextmanager
def patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(obj, name, value)`` set for the ``with`` block, and put back after it."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
