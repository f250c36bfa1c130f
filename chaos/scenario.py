"""One chaos run: M intents enqueued K times into real prefork workers that are being killed.

:func:`run_scenario` does, for one :class:`Scenario`:

1. starts the provider (the project's :class:`FakeProvider` over HTTP, with or without
   de-duplication on ``Idempotency-Key``, or the :class:`SMTPSink`) and ``workers`` Celery
   workers (``-P prefork -c 2``, subprocesses in process groups of their own);
2. enqueues every intent ``copies`` times in a random interleaving, paced over
   ``enqueue_seconds``, while a fault thread queues provider faults (accept-then-drop,
   accept-then-500, 503-before-accept, slow past the client timeout) and a chaos thread
   SIGKILLs random pool children and whole workers (which it restarts);
3. waits, with a deadline, until every ledger record is final and the broker queue is empty;
4. judges from the provider's own records (deliveries, and every request per key) and the
   ledger, never from return values: :func:`verdict` turns what a run measured into its problems,
   including a disturbance that was planned and never happened.

Every kill, fault and phase goes to a JSON-lines event log. Everything the run creates lives
under its own namespace (queue, Redis key prefixes, SQL table) and is removed at the end;
the workers are reaped whatever happens (see :mod:`chaos.procs`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from idemmail_celery.bulk import CAMPAIGN_TASK
from idemmail_celery.config import Settings
from idemmail_celery.handler import LEASE_MARGIN_SECONDS
from idemmail_celery.ledger import Ledger, State, from_url
from idemmail_celery.ledger.redis import RedisLedger
from idemmail_celery.ledger.sql import SQLLedger
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.redrive import redelivered_after
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, Attempt, FakeProvider
from idemmail_celery.testing.redis_server import RedisServer
from idemmail_celery.testing.smtp_sink import SMTPSink

from .procs import WorkerProcess, stop_all, wait_until
from .workerapp import (
    KEY_SECRET,
    KEYLESS_TASK,
    build_app,
    publishes_key,
    receipts_key,
    trace_key,
    worker_env,
)

REDIS_URL = os.environ.get("CHAOS_REDIS", "redis://127.0.0.1:6379/0")
RABBITMQ_URL = os.environ.get("CHAOS_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
POSTGRES_URL = os.environ.get("CHAOS_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

HTTP_FAULTS = ("drop_after_accept", "500_after_accept", "503_before_accept", "slow")
SMTP_FAULTS = ("drop_after_data", "stall_after_data", "tempfail_data_command")
PROVIDERS = ("http", "http-keyless", "smtp")
FINAL = {State.SENT.value, State.FAILED.value, State.REVIEW.value}
#: Applied faults per kind above which every kind must have been applied (4 kinds, 40 draws: a kind misses by
#: chance about once in 25,000 runs).
FAULTS_PER_KIND_FOR_ALL = 10
#: Outcomes of a request the de-duplicating fake answered from its memory of the key (a replay, or a 409
#: for a rewritten body or a request still in flight): a copy that reached the provider and that only
#: the provider kept from being a second email. Each must have a cause the library could not see past.
DEDUPED_OUTCOMES = ("replayed", "key_payload_mismatch", "in_flight")
#: Faults that leave the sender unable to know whether the provider has the message: the library
#: resends under the same key, and the provider's de-duplication is what answers.
AMBIGUOUS_FAULTS = ("drop_after_accept", "500_after_accept", "slow")
#: A request the provider delivered this close before it was stopped may have lost its answer to the stop
#: (provider-outage, 2026-11-29: one request recorded 5 ms before the stop, its connection cut unanswered).
STOP_CUT_SECONDS = 1.0
#: Requests answered from the key's memory per ambiguous fault on that key at most (measured: about 1.0;
#: a slow fault can add a 409 for the request still in flight before the replay).
DEDUPED_PER_FAULT = 3
@dataclass
class Scenario:
    """What one run does. Times are seconds."""

    name: str
    broker: str = "redis"  # redis | rabbitmq
    ledger: str = "redis"  # redis | postgresql | valkey (a Valkey 9 server of the run's own)
    provider: str = "http"  # http (dedupes on the key) | http-keyless (dedupe off) | smtp
    intents: int = 300
    copies: int = 3
    workers: int = 3
    concurrency: int = 2
    pool: str = "prefork"  # prefork | gevent | threads (no pool children to kill: set whole_worker_share=1)
    kills: int = 6
    whole_worker_share: float = 0.35  # of the kills, the share that takes a whole worker down
    kill_interval: float = 2.0  # mean time between kills
    fault_rate: float = 0.05  # share of provider requests that get a fault
    enqueue_seconds: float = 10.0
    lease: float = 3.0
    visibility_timeout: float = 10.0
    provider_timeout: float = 1.0
    slow_seconds: float = 1.5
    flush_ledger_at: float | None = None  # ledger-loss drill: flush when this share of intents is delivered
    loss_seconds: float = 10.0  # ledger-loss drill: how long the loss stands before an operator acknowledges it
    deadline: float = 600.0
    seed: int = 0
    #: The library's default settings (lease, backoffs, retry budget) instead of the chaos runs' short ones.
    defaults: bool = False
    #: How long the provider takes over every send (seconds): a real provider's 50-300 ms keeps sends in
    #: flight, so a whole-worker kill cuts some short.
    latency: float = 0.0
    #: Campaign mode: the intents are the recipients of this many ``send_campaign`` calls (each enqueued
    #: ``copies`` times), not single sends.
    campaigns: int = 0
    #: The ledger is a Redis of the run's own, stopped for ``blip_seconds`` this many times mid-run.
    ledger_blips: int = 0
    blip_seconds: float = 3.0
    #: When this share of the intents is delivered, every worker is restarted with a rotated key secret
    #: (``[new, old]``).
    rotate_secret_at: float | None = None
    #: Rotate in one rolling deploy, ``[old]`` -> ``[new, old]`` (the roster makes it safe), not in two.
    rotate_in_one_step: bool = False
    #: Seconds between two workers' restarts in a rotation: how long workers of both kinds run side by side.
    rotate_pause: float = 0.0
    #: The Redis transport's own unacked-restore settings (not the quick ones the other runs use).
    restore_defaults: bool = False
    #: The provider is stopped (connections refused) for this long once ``outage_at`` of the intents are
    #: delivered, then started again on the same port.
    provider_outage: float = 0.0
    outage_at: float = 0.2

    @property
    def keyed(self) -> bool:
        """Does the downstream de-duplicate on the key (the HTTP fake with dedupe on)?"""
        return self.provider == "http"

    @property
    def drill(self) -> bool:
        return self.flush_ledger_at is not None


@dataclass
class Result:
    """What a run found. ``ok`` is the verdict; ``problems`` says why not."""

    scenario: Scenario
    ns: str
    log_dir: str
    intents: int = 0
    messages: int = 0
    deliveries: int = 0
    duplicates: int = 0
    missing: int = 0
    unknown_deliveries: int = 0
    states: dict[str, int] = field(default_factory=dict)
    reviews: int = 0
    reviews_delivered: int = 0
    review_reasons: dict[str, int] = field(default_factory=dict)
    undelivered_not_review: int = 0
    no_record: int = 0
    child_kills: int = 0
    worker_kills: int = 0
    faults: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    posts: int = 0
    suppressed: int = 0
    #: Requests the provider answered from its memory of the key (see :data:`DEDUPED_OUTCOMES`); in a
    #: drill, those before the flush (the drill's own rules judge the rest).
    deduped: int = 0
    #: Of those, the ones under keys that no ambiguous fault hit (a kill or an overlapping copy must explain them).
    deduped_unexplained: int = 0
    ambiguous_faults: int = 0  # faults of :data:`AMBIGUOUS_FAULTS` that acted on an accepted request
    wall: float = 0.0
    stuck: bool = False
    executions: int = 0
    redelivered: int = 0
    overlapping: int = 0
    records_flushed: int = 0
    delivered_at_flush: int = 0  # intents the provider had delivered when the drill flushed the ledger
    acknowledged: bool = False  # the drill's loss was acknowledged (``ledger ack-loss``)
    resends_before_ack: int = 0  # POSTs for intents already delivered, between the flush and the acknowledgement
    requests_before_ack: int = 0  # POSTs of any kind in that window (sends under way at the flush land in it)
    requests_while_lost: int = 0  # POSTs of any kind after those landed, before the acknowledgement
    lost_seconds: float = 0.0  # from the flush to the acknowledgement
    resends: int = 0  # POSTs for intents already delivered, after the acknowledgement
    resent_deliveries: int = 0
    max_copies_per_task: int = 0  # the most times the broker handed out one task id (reschedules included)
    #: Of the task id with the most forks no kill explains (see :class:`Copies`): its lineages, and those forks.
    max_lineages: int = 0
    unexplained_forks: int = 0
    longest_chain: int = 0  # the most messages of one task id published one after another (hops of one lineage)
    max_concurrent_copies: int = 0  # the most executions of one task id running at the same time
    killed_executions: int = 0  # executions a whole-worker kill cut short
    kill_to_delivery: list[float] = field(default_factory=list)  # s from each such kill to its intent's delivery
    kill_to_settled: list[float] = field(default_factory=list)  # s from each such kill to its intent's final record
    #: What the design allows from a kill to the final record, before the broker's queue wait (see
    #: :class:`RecoveryDesign`), and each intent a whole-worker kill cut short, against it.
    recovery_design: float = 0.0
    recoveries: list[Recovery] = field(default_factory=list)
    ledger_blips: int = 0
    rotated: bool = False
    split_records: int = 0  # intents recorded under both their old and their new key (a rotation gone wrong)
    drained: bool = True
    outage_seconds: float = 0.0  # how long the provider was down (0: no outage in this run)
    delivered_at_outage: int = 0  # intents delivered when it went down
    recovery_seconds: float = 0.0  # from its return to the last intent's first delivery
    ok: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.child_kills + self.worker_kills

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kills"] = self.kills
        return out


class EventLog:
    """Thread-safe JSON-lines log: one object per event, with seconds since the run started."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self.counts: Counter[str] = Counter()

    def __call__(self, event: str, **fields: Any) -> None:
        line = {"t": round(time.monotonic() - self.t0, 3), "at": round(time.time(), 3), "event": event, **fields}
        with self._lock:
            self.counts[event] += 1
            self._file.write(json.dumps(line, default=str) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


# -- the provider side: what was delivered, per key --


class ProviderUnderTest:
    """The fake provider a run sends to, seen through the questions the verdict asks."""

    kinds: tuple[str, ...] = ()
    url = ""
    api_key = ""

    def start(self) -> None: ...
    def stop(self) -> None: ...

    def requests(self) -> int:
        """Requests received so far (POSTs, or SMTP messages recorded)."""
        raise NotImplementedError

    def delivered(self) -> int:
        """Deliveries so far (cheap: polled while the run goes on)."""
        raise NotImplementedError

    def queue_fault(self, kind: str) -> None:
        raise NotImplementedError

    def deliveries_by_key(self) -> Counter[str]:
        raise NotImplementedError

    def applied_faults(self) -> list[dict[str, Any]]:
        """The faults that hit a request: kind, key (when known), time."""
        raise NotImplementedError

    def suppressed(self) -> int:
        return 0

    def attempts_after(self, when: float, keys: set[str]) -> tuple[int, int]:
        """(requests, deliveries) for ``keys`` received after the epoch time ``when``."""
        return 0, 0

    def deduped(self, until: float | None = None, cut: tuple[float, float] | None = None) -> tuple[int, int, int]:
        """(requests answered from the key's memory, those of them under keys no ambiguous fault hit,
        ambiguous faults), of the requests received up to the epoch time ``until``; ``cut``: the span in which
        stopping the provider may have cut a delivered request's answer (an ambiguous fault of its own)."""
        return 0, 0, 0

    def first_delivery_times(self) -> dict[str, float]:
        """key -> when it was first delivered (epoch seconds); empty where the provider cannot tell."""
        return {}


class HTTPFake(ProviderUnderTest):
    """:class:`FakeProvider`: Resend-compatible, de-duplicating on ``Idempotency-Key`` or not."""

    kinds = HTTP_FAULTS

    def __init__(self, *, dedupe: bool, slow_seconds: float, max_records: int, latency: float = 0.0) -> None:
        self.fake = FakeProvider(dedupe=dedupe, slow_seconds=slow_seconds, max_records=max_records, latency=latency)
        self.api_key = DEFAULT_API_KEY

    def start(self) -> None:
        self.fake.start()
        self.url = self.fake.url

    def stop(self) -> None:
        self.fake.stop()

    def requests(self) -> int:
        return self.fake.attempt_count()

    def delivered(self) -> int:
        return self.fake.delivery_count()

    def queue_fault(self, kind: str) -> None:
        self.fake.fail_next(kind)

    def deliveries_by_key(self) -> Counter[str]:
        return Counter(d.key or "<none>" for d in self.fake.deliveries())

    def applied_faults(self) -> list[dict[str, Any]]:
        return [{"kind": a.fault, "key": a.key, "at": a.at, "outcome": a.outcome, "status": a.status}
                for a in self.fake.attempts() if a.fault]

    def suppressed(self) -> int:
        return self.fake.duplicates_suppressed()

    def first_delivery_times(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in self.fake.deliveries():
            if d.key and (d.key not in out or d.at < out[d.key]):
                out[d.key] = d.at
        return out

    def attempts_after(self, when: float, keys: set[str]) -> tuple[int, int]:
        posts = sum(1 for a in self.fake.attempts() if a.at > when and a.key in keys)
        delivered = sum(1 for d in self.fake.deliveries() if d.at > when and d.key in keys)
        return posts, delivered

    def deduped(self, until: float | None = None, cut: tuple[float, float] | None = None) -> tuple[int, int, int]:
        return tally_deduped(self.fake.attempts(), until, cut)


def tally_deduped(attempts: list[Attempt], until: float | None = None,
                  cut: tuple[float, float] | None = None) -> tuple[int, int, int]:
    """Per key, the requests a de-duplicating provider answered from its memory of the key, against the
    ambiguous faults that hit the key: (deduped, deduped under keys no such fault hit, ambiguous faults).

    Attempts after the epoch time ``until`` are left out: after a drill's flush, copies of intents whose
    record was lost reach the provider by design, and the drill's own rules judge them. A request delivered
    within ``cut`` (from :data:`STOP_CUT_SECONDS` before a stop of the provider to its end) counts as an
    ambiguous fault: the stop may have closed its connection before the answer went out."""
    deduped: Counter[str | None] = Counter()
    ambiguous: Counter[str | None] = Counter()
    for a in attempts:
        if until is not None and a.at > until:
            continue
        if a.outcome.startswith(DEDUPED_OUTCOMES):
            deduped[a.key] += 1
        # A fault that met a 409 did nothing: the request was refused, and its sender knows it.
        cut_off = cut is not None and cut[0] <= a.at <= cut[1]
        if (a.fault in AMBIGUOUS_FAULTS or cut_off) and a.outcome.startswith(("delivered", "replayed")):
            ambiguous[a.key] += 1
    unexplained = sum(n for key, n in deduped.items() if not ambiguous[key])
    return sum(deduped.values()), unexplained, sum(ambiguous.values())


class SMTPFake(ProviderUnderTest):
    """:class:`SMTPSink`: no key support; deliveries are told apart by their ``<key@domain>`` Message-ID."""

    kinds = SMTP_FAULTS

    def __init__(self) -> None:
        self.sink = SMTPSink()

    def start(self) -> None:
        self.sink.start()
        self.url = self.sink.url

    def stop(self) -> None:
        self.sink.stop()

    def requests(self) -> int:
        return self.sink.count()

    def delivered(self) -> int:
        return self.sink.count()

    def queue_fault(self, kind: str) -> None:
        self.sink.fail_next(kind)  # type: ignore[arg-type]

    def deliveries_by_key(self) -> Counter[str]:
        return Counter(_smtp_key(m.message_id) or "<none>" for m in self.sink.messages())

    def applied_faults(self) -> list[dict[str, Any]]:
        # As the sink applied them: a fault still queued at the end hit nothing, and is not counted.
        return [{"kind": f.kind, "key": _smtp_key(f.message_id), "at": f.at} for f in self.sink.applied()]


def _smtp_key(message_id: str | None) -> str | None:
    """The intent key in a ``<key@domain>`` Message-ID."""
    return message_id.strip("<>").split("@", 1)[0] if message_id else None


def make_provider(s: Scenario) -> ProviderUnderTest:
    if s.provider == "smtp":
        return SMTPFake()
    if s.provider in ("http", "http-keyless"):
        return HTTPFake(dedupe=s.provider == "http", slow_seconds=s.slow_seconds,
                        max_records=max(10_000, s.intents * s.copies * 4), latency=s.latency)
    raise ValueError(f"unknown provider {s.provider!r} (known: {', '.join(PROVIDERS)})")


# -- the ledger and the broker, seen from outside --


class LedgerView:
    """The run's ledger, read the way an operator would (and flushed for the drill)."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url, self.options = url, options
        self.ledger: Ledger = from_url(url, **options)
        self.ledger.ping()  # connects (an SQL ledger creates its table here)

    def state_counts(self) -> Counter[str]:
        """Records per state, in one or two store requests."""
        led = self.ledger
        if isinstance(led, RedisLedger):
            return Counter(led.stats())
        if isinstance(led, SQLLedger):
            import sqlalchemy as sa

            t = led.table
            with led.engine.connect() as conn:
                rows = conn.execute(sa.select(t.c.state, sa.func.count()).group_by(t.c.state)).all()
            return Counter({str(state): int(n) for state, n in rows})
        raise TypeError(type(led).__name__)

    def states(self, keys: list[str]) -> dict[str, Any]:
        """key -> Record (or None), one request per key."""
        return {k: self.ledger.get(k) for k in keys}

    def flush(self) -> int:
        """Lose the ledger: delete every record (Redis keys or SQL rows). Returns how many records went."""
        led = self.ledger
        if isinstance(led, RedisLedger):
            names = list(led.client.scan_iter(f"{led.prefix}:*", count=1000))
            # A record in progress is a key of its own (``:r:``); a sent one is an entry on a shelf (``:d:``,
            # a hash whose field "" is its sweep time, not a record): both are records lost.
            shelves = [n for n in names if ":d:" in n]
            # All at one instant (MULTI/EXEC), as a restart without persistence or a FLUSHDB loses them, and
            # counted in the same transaction. Deleted batch by batch, a claim could find its record gone and
            # its bucket's epoch marker still there for a moment: the partial loss docs/operations.md says
            # markers cannot tell.
            pipe = led.client.pipeline(transaction=True)
            for n in shelves:
                pipe.hlen(n)
                pipe.hexists(n, "")
            for i in range(0, len(names), 500):
                pipe.delete(*names[i:i + 500])
            replies = pipe.execute()[:2 * len(shelves)]
            on_shelves = sum(int(n) - int(sweep) for n, sweep in zip(replies[::2], replies[1::2], strict=True))
            return sum(1 for n in names if ":r:" in n) + on_shelves
        if isinstance(led, SQLLedger):
            import sqlalchemy as sa

            with led.engine.connect() as conn:
                return int(conn.execute(sa.delete(led.table)).rowcount)
        raise TypeError(type(led).__name__)

    def loss_state(self) -> str:
        """``ok``, ``new`` or ``lost``, as ``ledger stats`` shows it (Redis only)."""
        led = self.ledger
        return str(led.loss_status()["state"]) if isinstance(led, RedisLedger) else "durable"

    def acknowledge_loss(self, note: str) -> subprocess.CompletedProcess[str]:
        """What the operator does: ``ledger ack-loss`` through the CLI, in a process of its own."""
        assert isinstance(self.ledger, RedisLedger)
        return subprocess.run(
            [sys.executable, "-m", "idemmail_celery", "--ledger-url", self.url, "--prefix", self.ledger.prefix,
             "ledger", "ack-loss", "--note", note, "--actor", "chaos-drill"],
            capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])

    def drop(self) -> None:
        led = self.ledger
        if isinstance(led, RedisLedger):
            names = list(led.client.scan_iter(f"{led.prefix}:*", count=1000))
            for i in range(0, len(names), 500):
                led.client.delete(*names[i:i + 500])
        elif isinstance(led, SQLLedger):
            with contextlib.suppress(Exception):
                led.drop_table()
        led.close()


class BrokerView:
    """Queue depth and clean-up for the run's own queue (Redis: its own key prefix too)."""

    def __init__(self, app: Any, broker_url: str, ns: str, queue: str) -> None:
        self.app, self.url, self.ns, self.queue = app, broker_url, ns, queue
        self.redis = redis.Redis.from_url(broker_url, decode_responses=True) if broker_url.startswith("redis") else None

    def drained(self) -> bool:
        """Is the queue empty? A read that times out (the broker busy under the restarts) is a "not yet"."""
        try:
            return self.depth() == 0
        except (redis.RedisError, OSError) as exc:
            print(f"chaos: broker depth not read ({type(exc).__name__}); trying again", file=sys.stderr, flush=True)
            return False

    def depth(self) -> int:
        """Messages waiting plus (Redis) messages handed out but not yet acknowledged."""
        if self.redis is not None:
            p = f"{self.ns}."
            pipe = self.redis.pipeline(transaction=False)
            pipe.llen(p + self.queue)
            pipe.hlen(p + "unacked")
            return sum(int(n) for n in pipe.execute())
        with self.app.connection_for_write() as conn:
            try:
                _, count, _ = conn.default_channel.queue_declare(self.queue, passive=True)
            except Exception:
                return 0
            return int(count)

    def describe(self) -> dict[str, Any]:
        """Where the messages not yet acknowledged are (Redis): waiting in the queue, handed out (the oldest,
        seconds ago), and how long the lock of the transport's restore scan is still held."""
        if self.redis is None:
            return {"depth": self.depth()}
        p = f"{self.ns}."
        oldest = [float(pair[1]) for pair in self.redis.zrange(p + "unacked_index", 0, 0, withscores=True)]
        return {"queued": self.redis.llen(p + self.queue), "unacked": self.redis.hlen(p + "unacked"),
                "oldest_unacked_s": round(time.time() - oldest[0], 1) if oldest else None,
                "restore_lock_ttl_s": self.redis.ttl(p + "unacked_mutex")}

    def cleanup(self) -> None:
        """Delete the run's queue (RabbitMQ) and every Redis key under its namespace (broker, trace)."""
        if self.redis is None:
            with contextlib.suppress(Exception), self.app.connection_for_write() as conn:
                ch = conn.default_channel
                ch.queue_delete(self.queue)
                ch.exchange_delete(self.queue)
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        for c in [client] + ([self.redis] if self.redis is not None else []):
            names = list(c.scan_iter(f"{self.ns}.*", count=1000))
            for i in range(0, len(names), 500):
                c.delete(*names[i:i + 500])
            c.close()


# -- the copies of one task id: messages, their deliveries, and the lineages they form --


@dataclass
class Delivery:
    """One execution of a message: where and when it started, and whether it ended (a kill cuts it short)."""

    pid: int
    start: float
    key: str | None
    ended: bool
    redelivered: bool = False


@dataclass
class Message:
    """One message of a task id as the broker held it: a hop of its chain. The broker handing it out again
    (after a kill, or its visibility timeout) is the same message delivered twice, not a new one."""

    task_id: str
    hop: str
    parent: str | None = None  # the message of the same task id whose delivery published this one
    published: float | None = None
    due: float | None = None  # when it was to run: published, plus its countdown
    deliveries: list[Delivery] = field(default_factory=list)
    children: list[str] = field(default_factory=list)  # messages its deliveries published, in order

    @property
    def cut_short(self) -> int:
        return sum(1 for d in self.deliveries if not d.ended)


@dataclass
class Copies:
    """One task id's messages. A chain that waits hops from message to message: each delivery publishes
    the next and is acknowledged, one message alive at a time, however many hops. Copies multiply when one
    message publishes a next message twice (two deliveries of it each carried on): a fork, and one more
    lineage alive. A delivery cut short by a kill after its publish, and handed out again, forks by design
    (the broker cannot know the first one carried on); any other fork is the library multiplying copies."""

    task_id: str
    messages: dict[str, Message] = field(default_factory=dict)
    key: str | None = None  # the intent's

    def message(self, hop: str) -> Message:
        return self.messages.setdefault(hop, Message(self.task_id, hop))

    @property
    def deliveries(self) -> int:
        """How many times the broker handed this task id out (every hop and redelivery)."""
        return sum(len(m.deliveries) for m in self.messages.values())

    @property
    def lineages(self) -> int:
        """Messages published by nobody of this task id, plus one per fork."""
        roots = sum(1 for m in self.messages.values() if m.parent is None or m.parent not in self.messages)
        return roots + sum(max(0, len(m.children) - 1) for m in self.messages.values())

    @property
    def unexplained_forks(self) -> int:
        """Forks beyond one per delivery of the forking message that a kill cut short."""
        return sum(max(0, len(m.children) - 1 - m.cut_short) for m in self.messages.values())

    @property
    def longest_chain(self) -> int:
        """The most messages one after another (hops of one lineage)."""
        depth: dict[str, int] = {}

        def walk(hop: str) -> int:
            if hop not in depth:
                depth[hop] = 0  # a cycle cannot happen (a hop id is new on every publish); this guards anyway
                m = self.messages[hop]
                depth[hop] = 1 + (walk(m.parent) if m.parent in self.messages else 0)
            return depth[hop]

        return max((walk(h) for h in self.messages), default=0)

    def lineage(self, hop: str) -> list[Message]:
        """The message ``hop`` and every message its deliveries, and theirs, published (each once)."""
        out, todo, seen = [], [hop], set()
        while todo:
            name = todo.pop()
            m = self.messages.get(name)
            if m is not None and name not in seen:  # a cycle cannot happen (see copies_by_task); guarded anyway
                seen.add(name)
                out.append(m)
                todo.extend(m.children)
        return out


def copies_by_task(receipts: list[list[Any]], ends: set[tuple[str, int, float]],
                   publishes: list[list[Any]], enqueued: dict[str, float] | None = None) -> dict[str, Copies]:
    """Each task id's messages, from what the workers recorded (see :mod:`chaos.workerapp`): ``receipts``
    (task id, pid, start, key, message, redelivered), ``ends`` (task id, pid, start) of the executions
    that ended, ``publishes`` (task id, message, publishing task id, its message, when, due) and
    ``enqueued`` (task id -> when the orchestrator published it)."""
    out: dict[str, Copies] = {}
    for task_id, hop, parent_id, parent_hop, at, due in publishes:
        copies = out.setdefault(task_id, Copies(task_id))
        m = copies.message(hop)
        m.published, m.due = at, due
        # A copy of a reschedule whose first copy has not said it published comes back as the same hop (see
        # Handler.in_flight): the message published again, not a child of itself (no fork, and no cycle).
        if parent_id == task_id and parent_hop is not None and parent_hop != hop:
            m.parent = parent_hop
            copies.message(parent_hop).children.append(hop)
    for task_id, at in (enqueued or {}).items():
        m = out.setdefault(task_id, Copies(task_id)).message(task_id)
        if m.published is None:
            m.published = m.due = at
    for line in receipts:
        task_id, pid, start, key = line[:4]
        hop = line[4] if len(line) > 4 else task_id
        redelivered = bool(line[5]) if len(line) > 5 else False
        copies = out.setdefault(task_id, Copies(task_id))
        copies.key = copies.key or key
        copies.message(hop).deliveries.append(Delivery(pid, start, key, (task_id, pid, start) in ends, redelivered))
    return out


# -- how long an intent whose holder a kill cut short may wait for its final record --


@dataclass(frozen=True)
class RecoveryDesign:
    """The recovery path of an intent whose holder a whole-worker kill cut short, from the settings the workers
    run with (:func:`recovery_design`). The holder's lease, renewed every third of it, runs out at most
    ``lease`` after the kill; the broker hands the killed message out again at most ``redelivered`` after it.
    Handed out before the lease ran out, the message finds the claim held and waits on it: each reschedule
    comes back at most ``margin`` past the lease (``LEASE_MARGIN_SECONDS``), and then takes the claim over
    and resends with the key (at most the provider timeout, ``send``). A provider fault on that send adds a
    retry: its backoff and one more send."""

    lease: float
    margin: float
    redelivered: float
    send: float
    retry_backoff: float
    retry_backoff_max: float

    @property
    def waits(self) -> float:
        """From the kill to the takeover, for a broker that hands due messages out at once."""
        return max(self.lease + self.margin, self.redelivered)

    def bound(self, queue_wait: float = 0.0, faults: int = 0) -> float:
        """Seconds from the kill to the final record. ``queue_wait``: the longest the broker kept a message of the
        path waiting past its due time (measured: a deep queue holds every message alike, a reschedule behind the
        whole backlog); each of ``faults`` adds a retry's backoff, a send and one more such wait."""
        retries = sum(min(self.retry_backoff_max, self.retry_backoff * 2.0 ** i) for i in range(faults))
        return self.waits + (1 + faults) * (self.send + queue_wait) + retries


def recovery_design(app: Any, task_name: str, pool: str) -> RecoveryDesign:
    """The :class:`RecoveryDesign` of ``app``'s task ``task_name`` on workers of ``pool``, from the library's own
    settings (a pool without kombu's event loop restores on the library's timer)."""
    policy = app.tasks[task_name].policy
    timeout = Settings.resolve(app.conf).provider_timeout
    return RecoveryDesign(lease=policy.lease_seconds, margin=LEASE_MARGIN_SECONDS,
                          redelivered=redelivered_after(app, event_loop=pool == "prefork"),
                          send=float(timeout or 30.0), retry_backoff=policy.retry_backoff,
                          retry_backoff_max=policy.retry_backoff_max)


@dataclass
class Recovery:
    """One intent whose holder a whole-worker kill cut short: from the last such kill before its final record
    (each kill of a holder starts the wait again) to that record, against :meth:`RecoveryDesign.bound`."""

    key: str
    kill_at: float
    settled_after: float  # seconds from the kill to the final record
    queue_wait: float  # the longest a message of its recovery path waited past its due time
    faults: int  # provider faults on its key in between
    allowed: float

    @property
    def over(self) -> float:
        return self.settled_after - self.allowed


def recoveries(killed: list[tuple[str, str, str, float]], by_task: dict[str, Copies], settled_at: dict[str, float],
               faults_at: dict[str, list[float]], design: RecoveryDesign) -> list[Recovery]:
    """Each intent of ``killed`` (task id, message, key, kill time: executions a whole-worker kill cut short),
    judged from its last kill before its final record (``settled_at``).

    The path the design relies on is the killed message's: handed out again, then rescheduled on the lease
    (its lineage), and any message a worker published for the intent after the kill (another copy's reschedule
    or retry). A copy the caller enqueued is not on it: the caller could enqueue it at any time. The killed
    message itself is held to the design's redelivery time, its lateness never counted as the queue's: the
    transport restores it to the head of the queue, and one restored late is a restore that failed (a timer
    restoring ten messages a pass handed a killed green worker's last messages back a minute late)."""
    by_key: dict[str, list[Copies]] = {}
    for copies in by_task.values():
        if copies.key:
            by_key.setdefault(copies.key, []).append(copies)
    last: dict[str, tuple[float, str, str]] = {}
    for task_id, hop, key, kill_at in killed:
        settled = settled_at.get(key)
        if settled is not None and kill_at < settled and kill_at > last.get(key, (0.0, "", ""))[0]:
            last[key] = (kill_at, task_id, hop)
    out: list[Recovery] = []
    for key, (kill_at, task_id, hop) in sorted(last.items()):
        settled = settled_at[key]
        path = [m for m in (by_task[task_id].lineage(hop) if task_id in by_task else [])
                if m.hop != hop and m.published is not None and m.published >= kill_at]
        for copies in by_key.get(key, []):
            path += [m for m in copies.messages.values()
                     if m.published is not None and m.published >= kill_at and m.parent is not None
                     and copies.task_id != task_id]
        waited = 0.0
        for m in path:
            due = m.due if m.due is not None else m.published
            assert due is not None
            if due >= settled:
                continue  # not due before the intent settled: nothing waited on it
            handed = min((d.start for d in m.deliveries if d.start >= kill_at), default=settled)
            waited = max(waited, min(handed, settled) - max(due, kill_at))
        faults = sum(1 for at in faults_at.get(key, []) if kill_at <= at <= settled)
        out.append(Recovery(key=key, kill_at=kill_at, settled_after=round(settled - kill_at, 2),
                            queue_wait=round(waited, 2), faults=faults,
                            allowed=round(design.bound(waited, faults), 2)))
    return out


# -- the run --


def _geometric(rng: random.Random, p: float) -> int:
    """Requests to let through before the next fault (mean ``1/p - 1``)."""
    if p <= 0:
        return 1 << 60
    n = 0
    while rng.random() > p:
        n += 1
    return n


class Run:
    """The moving parts of one scenario, and the threads that torment them."""

    def __init__(self, s: Scenario, log_dir: Path) -> None:
        self.s = s
        self.rng = random.Random(s.seed)
        self.ns = f"chaos{s.seed}x{uuid.uuid4().hex[:6]}"
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(log_dir / "events.jsonl")
        self.stop = threading.Event()
        self.enqueued = threading.Event()
        self.plans: list[threading.Event] = []  # one per planned disturbance (kills, blips, rotation): done
        self.errors: list[str] = []
        self.provider = make_provider(s)
        self.workers: list[WorkerProcess] = []
        self.child_kills = 0
        self.worker_kills = 0
        self.worker_kill_times: list[tuple[float, set[int]]] = []
        self.flush_time: float | None = None
        self.ack_time: float | None = None
        self.acked = threading.Event()
        self.flushed_keys: set[str] = set()
        self.records_flushed = 0
        self.requests_at_flush = 0
        self.requests_at_settled = 0
        self.requests_at_ack = 0
        self.messages = 0
        self.enqueued_at: dict[str, float] = {}  # task id -> when the orchestrator published it
        # A ledger of the run's own to stop and start (the blips), and one restart of a worker at a time.
        self.ledger_server = (RedisServer(log_dir / f"ledger-{s.ledger}", server=s.ledger)
                              if s.ledger_blips or s.ledger == "valkey" else None)
        self.restart_lock = threading.Lock()
        self.blips = 0
        self.rotated = False
        self.outage: tuple[float, float] | None = None  # (down, back), epoch seconds
        self.cut: tuple[float, float] | None = None  # when stopping the provider may have cut an answer
        self.delivered_at_outage = 0

    # -- set-up --

    def config(self) -> dict[str, str]:
        s = self.s
        broker = REDIS_URL if s.broker == "redis" else RABBITMQ_URL
        ledger = REDIS_URL if s.ledger == "redis" else POSTGRES_URL
        if self.ledger_server is not None:
            ledger = self.ledger_server.url
        return {
            "key_secrets": "", "restore_defaults": "1" if s.restore_defaults else "",
            "ns": self.ns, "broker": broker, "ledger": ledger, "provider": self.provider.url,
            "provider_key": self.provider.api_key, "provider_timeout": str(s.provider_timeout),
            "lease": str(s.lease), "visibility_timeout": str(s.visibility_timeout), "trace": REDIS_URL,
            "defaults": "1" if s.defaults else "",
        }

    def task_name(self) -> str:
        return KEYLESS_TASK if self.s.provider == "http-keyless" else TASK_NAME

    def intent(self, i: int, copy: int) -> dict[str, Any]:
        if self.s.campaigns:  # recipient i of campaign c: the send_email call a campaign makes for it
            c = i % self.s.campaigns
            return {"to": f"user{i}@example.com", "subject": f"News {c}", "text": "hello",
                    "event_id": f"{self.ns}-campaign-{c}"}
        # The body differs per copy (an agent rewrote it); the intent is the event and the recipient.
        return {"to": f"user{i}@example.com", "subject": f"Receipt {i}", "text": f"copy {copy} of {i}",
                "event_id": f"{self.ns}-order-{i}", "template": "receipt"}

    def campaign(self, c: int) -> dict[str, Any]:
        """The ``send_campaign`` call of campaign ``c``: the intents ``i`` with ``i % campaigns == c``."""
        s = self.s
        return {"campaign_id": f"{self.ns}-campaign-{c}", "subject": f"News {c}", "text": "hello",
                "recipients": [f"user{i}@example.com" for i in range(c, s.intents, s.campaigns)], "batch_size": 25}

    # -- threads --

    def _guard(self, fn: Callable[[], None], name: str) -> Callable[[], None]:
        def body() -> None:
            try:
                fn()
            except Exception as exc:  # a broken harness must fail the run, loudly
                self.errors.append(f"{name}: {exc!r}")
                self.log("harness_error", thread=name, error=repr(exc))
        return body

    def _planned(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn``, a planned disturbance: the run waits for it to be done (the verdict requires it)."""
        done = threading.Event()
        self.plans.append(done)

        def body() -> None:
            fn()
            done.set()
        return body

    def enqueue(self, task: Any) -> None:
        s = self.s
        order = [i for i in range(s.campaigns or s.intents) for _ in range(s.copies)]
        self.rng.shuffle(order)
        copies: Counter[int] = Counter()
        self.log("enqueue_start", messages=len(order))
        t0 = time.monotonic()
        per = s.enqueue_seconds / max(1, len(order))
        for n, i in enumerate(order):
            if self.stop.is_set():
                break
            copies[i] += 1
            at = time.time()
            sent = task.apply_async(kwargs=self.campaign(i) if s.campaigns else self.intent(i, copies[i]))
            self.enqueued_at[sent.id] = at
            self.messages += 1
            ahead = t0 + (n + 1) * per - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        self.log("enqueue_done", messages=self.messages, seconds=round(time.monotonic() - t0, 2))
        self.enqueued.set()

    def inject_faults(self) -> None:
        s, provider = self.s, self.provider
        next_at = provider.requests() + _geometric(self.rng, s.fault_rate)
        kinds: list[str] = []
        while not self.stop.wait(0.01):
            # One fault at a time: the next is queued only after more requests went through.
            n = provider.requests()
            if n >= next_at:
                if not kinds:  # every kind in turn, in a shuffled order: each shows up in every run
                    kinds = list(provider.kinds)
                    self.rng.shuffle(kinds)
                kind = kinds.pop()
                provider.queue_fault(kind)
                self.log("fault_queued", kind=kind, after_requests=n)
                next_at = n + 1 + _geometric(self.rng, s.fault_rate)

    def kill_things(self) -> None:
        s = self.s
        deck: list[str] = []
        # Start once sends are flowing, so kills land mid-work.
        while not self.stop.is_set() and self.provider.requests() < 5:
            time.sleep(0.05)
        while not self.stop.is_set() and self.child_kills + self.worker_kills < s.kills:
            if self.stop.wait(s.kill_interval * self.rng.uniform(0.4, 1.6)):
                return
            alive = [w for w in self.workers if w.alive()]
            if not alive:
                continue
            w = self.rng.choice(alive)
            if not deck:  # one whole-worker kill in every round(1/share) kills, at a random place
                size = max(1, round(1 / s.whole_worker_share)) if s.whole_worker_share > 0 else 1
                deck = ["worker" if s.whole_worker_share > 0 else "child"] + ["child"] * (size - 1)
                self.rng.shuffle(deck)
            if deck.pop() == "worker" and len(alive) >= 2:
                with self.restart_lock:
                    pid, children = w.pid, w.pool_children()
                    w.kill()
                    self.worker_kills += 1
                    self.log("kill_worker", worker=w.name, pid=pid, children=children, signal="SIGKILL",
                             scope="process group")
                    # Executions run in the pool children, or in the worker itself (-P gevent, -P threads, solo).
                    self.worker_kill_times.append((time.time(), {*children, *([pid] if pid else [])}))
                    if self.stop.wait(self.rng.uniform(0.5, 2.0)):
                        return
                    t = time.monotonic()
                    w.start()
                    self.log("restart_worker", worker=w.name, pid=w.pid,
                             ready_after=round(time.monotonic() - t, 2))
            else:
                kids = w.pool_children()
                if not kids:
                    continue
                pid = self.rng.choice(kids)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    self.child_kills += 1
                    self.log("kill_pool_child", worker=w.name, worker_pid=w.pid, pid=pid, signal="SIGKILL")

    def blip_ledger(self) -> None:
        """Stop the run's ledger Redis for ``blip_seconds`` at random moments while sends flow, then start it."""
        s, server = self.s, self.ledger_server
        assert server is not None
        while not self.stop.is_set() and self.provider.requests() < 5:
            time.sleep(0.05)
        while not self.stop.is_set() and self.blips < s.ledger_blips:
            if self.stop.wait(s.enqueue_seconds / (s.ledger_blips + 1) * self.rng.uniform(0.5, 1.5)):
                return
            server.stop()
            self.blips += 1
            self.log("ledger_down", blip=self.blips)
            self.stop.wait(s.blip_seconds)
            server.start()
            self.log("ledger_up", blip=self.blips)

    def stop_provider(self) -> None:
        """Once ``outage_at`` of the intents are delivered, stop the provider for ``provider_outage`` seconds
        (every send is refused at connect: nothing was sent), then start it again on the same port."""
        s = self.s
        while not self.stop.wait(0.05):
            if self.provider.delivered() >= s.intents * s.outage_at:
                break
        else:
            return
        stopping = time.time()
        self.provider.stop()
        down = time.time()
        self.cut = (stopping - STOP_CUT_SECONDS, down)
        self.delivered_at_outage = self.provider.delivered()
        self.log("provider_down", delivered=self.delivered_at_outage, seconds=s.provider_outage)
        self.stop.wait(s.provider_outage)
        self.provider.start()
        self.outage = (down, time.time())
        self.log("provider_up", delivered=self.provider.delivered(), down_seconds=round(time.time() - down, 1))

    def rotate_secret(self) -> None:
        """Once ``rotate_secret_at`` of the intents are delivered, rotate the key secret worker by worker (a
        rolling redeploy, warm shutdowns): first ``[old, new]`` everywhere (keys still made under ``old``,
        records under ``new`` found), then ``[new, old]``; or ``[new, old]`` at once (``rotate_in_one_step``)."""
        s = self.s
        assert s.rotate_secret_at is not None
        while not self.stop.wait(0.1):
            if self.provider.delivered() >= s.intents * s.rotate_secret_at:
                break
        else:
            return
        steps = [[KEY_SECRET, f"{KEY_SECRET}-2"], [f"{KEY_SECRET}-2", KEY_SECRET]]
        for phase, secrets in enumerate(steps[1:] if s.rotate_in_one_step else steps, 1):
            self.log("key_secret_rotating", phase=phase, delivered=self.provider.delivered())
            for w in self.workers:
                with self.restart_lock:
                    w.env = {**w.env, "CHAOS_KEY_SECRETS": json.dumps(secrets)}  # a restart after a kill gets it too
                    if w.alive():
                        w.stop(timeout=60.0)  # a redeploy: warm shutdown, the running pass finishes or hands on
                        w.start()
                self.stop.wait(s.rotate_pause)
        self.rotated = True
        self.log("key_secret_rotated", secrets="[new, old]", delivered=self.provider.delivered())

    def flush_ledger(self, view: LedgerView) -> None:
        s = self.s
        assert s.flush_ledger_at is not None
        target = int(s.intents * s.flush_ledger_at)
        while not self.stop.wait(0.02):
            if self.provider.delivered() >= target:
                delivered = self.provider.deliveries_by_key()
                self.flush_time = time.time()
                self.flushed_keys = set(delivered)
                self.requests_at_flush = self.provider.requests()
                self.records_flushed = view.flush()
                self.log("ledger_flushed", records=self.records_flushed, intents_delivered=len(delivered),
                         note="Redis ledger keys deleted mid-run (the ledger-loss drill)")
                break
        else:
            return
        # The loss stands until an operator acknowledges it; workers must send nothing meanwhile,
        # once the sends already under way at the flush (claimed before it) have landed.
        settle = max(s.provider_timeout, s.slow_seconds) + 1.0
        if self.stop.wait(settle):
            return
        self.requests_at_settled = self.provider.requests()
        if self.stop.wait(max(0.0, s.loss_seconds - settle)):
            return
        self.log("loss_observed", state=view.loss_state(), requests_since_flush=self.provider.requests()
                 - self.requests_at_flush)
        self.requests_at_ack = self.provider.requests()
        self.ack_time = time.time()
        done = view.acknowledge_loss(f"chaos drill {self.ns}: ledger flushed on purpose")
        self.log("loss_acknowledged", exit_code=done.returncode, output=(done.stdout + done.stderr).strip())
        if done.returncode != 0:
            raise RuntimeError(f"ledger ack-loss failed: {done.stderr.strip()}")
        self.acked.set()

    # -- the whole run --

    def execute(self) -> Result:
        s = self.s
        result = Result(scenario=s, ns=self.ns, log_dir=str(self.log_dir), intents=s.intents)
        self.provider.start()
        if self.ledger_server is not None:
            self.ledger_server.start()
        config = self.config()
        app = build_app(config)
        task = app.tasks[self.task_name()]
        sender = app.tasks[CAMPAIGN_TASK] if s.campaigns else task
        queue = app.conf.task_default_queue
        broker = BrokerView(app, config["broker"], self.ns, queue)
        view = LedgerView(config["ledger"], {"retention_seconds": 7 * 24 * 3600.0, **app.conf.idemmail_ledger_options})
        self.log("run_start", scenario=asdict(s), ns=self.ns, provider_url=self.provider.url)
        threads: list[threading.Thread] = []
        t_start = time.monotonic()
        try:
            env = {**os.environ, **worker_env(config), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
            for n in range(s.workers):
                w = WorkerProcess(f"{self.ns}-w{n}", "chaos.workerapp",
                                  ["-P", s.pool, "-c", str(s.concurrency)], env, self.log_dir)
                self.workers.append(w)
            targets: list[tuple[str, Callable[[], None]]] = []
            if s.drill:  # every copy is in the queue before the first send: all of them predate the loss
                self.enqueue(sender)
            else:
                targets.append(("enqueue", lambda: self.enqueue(sender)))
            for w in self.workers:
                w.start()
                self.log("worker_started", worker=w.name, pid=w.pid, children=w.pool_children())
            t_start = time.monotonic()
            if s.fault_rate > 0:
                targets.append(("faults", self.inject_faults))
            if s.kills > 0:
                targets.append(("kills", self._planned(self.kill_things)))
            if s.drill:
                targets.append(("flush", lambda: self.flush_ledger(view)))
            if s.ledger_blips:
                targets.append(("blips", self._planned(self.blip_ledger)))
            if s.rotate_secret_at is not None:
                targets.append(("rotation", self._planned(self.rotate_secret)))
            if s.provider_outage:
                targets.append(("outage", self.stop_provider))
            for name, fn in targets:
                th = threading.Thread(target=self._guard(fn, name), name=f"chaos-{name}", daemon=True)
                th.start()
                threads.append(th)
            result.stuck = not self._wait_final(view, t_start)
            self.stop.set()
            for th in threads:
                th.join(timeout=120)
            self.log("chaos_stopped", child_kills=self.child_kills, worker_kills=self.worker_kills)
            for w in self.workers:  # a worker killed at the very end is brought back to drain its share
                if not w.alive():
                    w.start()
                    self.log("restart_worker", worker=w.name, pid=w.pid, ready_after=None)
            drained = wait_until(lambda: broker.drained(), timeout=max(60.0, s.visibility_timeout * 6),
                                 interval=0.25)
            self.log("queue_drained" if drained else "queue_not_drained", **broker.describe())
            result.drained = drained
            self._settle()
            stop_all(self.workers)
            self.log("workers_stopped")
            result.wall = time.monotonic() - t_start
            self._judge(result, task, view)
        finally:
            self.stop.set()
            for th in threads:  # no restart may slip in after the kills below
                th.join(timeout=30)
            for w in self.workers:
                w.kill()
            self.provider.stop()
            broker.cleanup()
            view.drop()
            if self.ledger_server is not None:
                self.ledger_server.stop()
            self.log("run_end", ok=result.ok, problems=result.problems)
            self.log.close()
        return result

    def _wait_final(self, view: LedgerView, t_start: float) -> bool:
        """Until every intent has a final record (the drill: until nothing is open and the queue is empty)."""
        s = self.s
        deadline = t_start + s.deadline
        last_log = 0.0
        while time.monotonic() < deadline:
            if self.errors:
                return False
            try:
                counts = view.state_counts()
            except Exception:  # the run's own ledger is blipped: look again when it is back
                time.sleep(0.5)
                continue
            final = sum(n for st, n in counts.items() if st in FINAL)
            open_ = sum(n for st, n in counts.items() if st not in FINAL)
            if time.monotonic() - last_log > 5:
                last_log = time.monotonic()
                self.log("progress", states=dict(counts), requests=self.provider.requests(),
                         enqueued=self.messages)
            # The run goes on until its planned disturbances have happened too: the verdict requires them.
            planned = all(done.is_set() for done in self.plans)
            if (self.enqueued.is_set() and planned and open_ == 0
                    and (final >= s.intents or (s.drill and self.acked.is_set()))):
                self.log("all_final", states=dict(counts))
                return True
            time.sleep(0.5)
        self.log("deadline_passed", states=dict(view.state_counts()))
        return False

    def _settle(self) -> None:
        """Let a slow request the client gave up on land at the provider before counting."""
        quiet = max(self.s.slow_seconds, self.s.provider_timeout) + 1.0
        last, since = self.provider.requests(), time.monotonic()
        deadline = time.monotonic() + 60
        while time.monotonic() - since < quiet and time.monotonic() < deadline:
            time.sleep(0.2)
            n = self.provider.requests()
            if n != last:
                last, since = n, time.monotonic()

    def _trace(self) -> tuple[int, int, int, int]:
        """(executions, redelivered executions, redelivered executions that overlapped a running one,
        the most executions of one task id that ran at one time)."""
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            lines = [json.loads(x) for x in client.lrange(trace_key(self.ns), 0, -1)]
        finally:
            client.close()
        by_id: dict[str, list[list[Any]]] = {}
        for line in lines:
            by_id.setdefault(line[0], []).append(line)
        overlapping = 0
        for runs in by_id.values():
            for run in runs:
                if run[4] and any(o is not run and o[1] != run[1] and o[2] <= run[2] <= o[3] for o in runs):
                    overlapping += 1
                    self.log("concurrent_copy", task_id=run[0], pid=run[1], started=run[2],
                             others=[(o[1], o[2], o[3]) for o in runs if o is not run])
        most = max((sum(1 for o in runs if o[2] <= run[2] <= o[3]) for runs in by_id.values() for run in runs),
                   default=0)
        return len(lines), sum(1 for line in lines if line[4]), overlapping, most

    def _receipts(self, r: Result, delivered_at: dict[str, float], settled_at: dict[str, float],
                  faults_at: dict[str, list[float]], design: RecoveryDesign) -> None:
        """Copies per task id (deliveries, messages, lineages), and the time from each whole-worker kill to the
        delivery and the final record of what it cut short, against the design (:func:`recoveries`). The raw
        lines go beside the event log."""
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        try:
            starts = [json.loads(x) for x in client.lrange(receipts_key(self.ns), 0, -1)]
            finished = [json.loads(x) for x in client.lrange(trace_key(self.ns), 0, -1)]
            publishes = [json.loads(x) for x in client.lrange(publishes_key(self.ns), 0, -1)]
        finally:
            client.close()
        for name, lines in (("receipts", starts), ("ends", finished), ("publishes", publishes)):
            with open(self.log_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        with open(self.log_dir / "enqueued.json", "w", encoding="utf-8") as f:
            json.dump(self.enqueued_at, f)
        # An execution is its task id, process and start: one task id may run again in the same process.
        ends = {(line[0], line[1], line[2]) for line in finished}
        by_task = copies_by_task(starts, ends, publishes, self.enqueued_at)
        if by_task:
            most = max(by_task.values(), key=lambda c: c.deliveries)
            r.max_copies_per_task = most.deliveries
            self.log("most_copies", task_id=most.task_id, copies=most.deliveries, lineages=most.lineages)
            widest = max(by_task.values(), key=lambda c: (c.unexplained_forks, c.lineages))
            r.max_lineages, r.unexplained_forks = widest.lineages, widest.unexplained_forks
            r.longest_chain = max(c.longest_chain for c in by_task.values())
            self.log("most_lineages", task_id=widest.task_id, lineages=widest.lineages,
                     unexplained_forks=widest.unexplained_forks, deliveries=widest.deliveries)
        # Executions that never ended were cut short by a kill: they end at the kill.
        killed: list[tuple[str, str, str, float]] = []
        for line in starts:
            task_id, pid, start, key = line[:4]
            if (task_id, pid, start) in ends:
                continue
            for kill_at, children in self.worker_kill_times:
                if pid in children and start <= kill_at:
                    r.killed_executions += 1
                    killed.append((task_id, line[4] if len(line) > 4 else task_id, key, kill_at))
                    done = delivered_at.get(key)
                    if done is not None and done > kill_at:
                        r.kill_to_delivery.append(round(done - kill_at, 2))
                    settled = settled_at.get(key)
                    if settled is not None and settled > kill_at:
                        r.kill_to_settled.append(round(settled - kill_at, 2))
                    break
        r.kill_to_delivery.sort()
        r.kill_to_settled.sort()
        r.recovery_design = design.bound()
        r.recoveries = recoveries(killed, by_task, settled_at, faults_at, design)
        for rec in r.recoveries:
            self.log("recovery", **asdict(rec), over=round(rec.over, 2))

    def _judge(self, r: Result, task: Any, view: LedgerView) -> None:
        s = self.s
        keys = [task.intent_key(**self.intent(i, 1)) for i in range(s.intents)]
        delivered = self.provider.deliveries_by_key()
        records = view.states(keys)
        r.ledger_blips, r.rotated = self.blips, self.rotated
        if self.rotated:  # an intent is one whether it went out (and was recorded) under its old or its new key
            # The new secret alone: with both, the key would follow the roster (idemmail_celery.roster).
            rotated = build_app({**self.config(), "key_secrets": json.dumps([f"{KEY_SECRET}-2"])})
            news = [rotated.tasks[task.name].intent_key(**self.intent(i, 1)) for i in range(s.intents)]
            for old, new in zip(keys, news, strict=True):
                delivered[old] += delivered.pop(new, 0)
                newer = view.ledger.get(new)
                if records[old] is not None and newer is not None:
                    r.split_records += 1
                records[old] = records[old] or newer
        known = set(keys)
        r.messages = self.messages
        r.deliveries = sum(delivered.values())
        r.duplicates = sum(n - 1 for k, n in delivered.items() if n > 1)
        r.missing = sum(1 for k in keys if delivered[k] == 0)
        r.unknown_deliveries = sum(n for k, n in delivered.items() if k not in known)
        states: Counter[str] = Counter()
        reasons: Counter[str] = Counter()
        for k in keys:
            rec = records[k]
            state = rec.state.value if rec is not None else "none"
            states[state] += 1
            if rec is not None and rec.state is State.REVIEW:
                reasons[str((rec.error or {}).get("reason"))] += 1
                if delivered[k]:
                    r.reviews_delivered += 1
            if delivered[k] == 0 and state != State.REVIEW.value:
                r.undelivered_not_review += 1
        r.states = dict(states)
        r.reviews = states[State.REVIEW.value]
        r.review_reasons = dict(reasons)
        r.no_record = states["none"]
        r.child_kills, r.worker_kills = self.child_kills, self.worker_kills
        applied = self.provider.applied_faults()
        r.faults = len(applied)
        r.faults_by_kind = dict(Counter(str(f["kind"]) for f in applied))
        for f in applied:
            self.log("fault_applied", **f)
        r.executions, r.redelivered, r.overlapping, r.max_concurrent_copies = self._trace()
        faults_at: dict[str, list[float]] = {}
        for f in applied:
            if f.get("key"):
                faults_at.setdefault(str(f["key"]), []).append(float(f["at"]))
        self._receipts(r, self.provider.first_delivery_times(),
                       {k: rec.updated_at for k, rec in records.items() if rec is not None and rec.state.is_final},
                       faults_at, recovery_design(task.app, task.name, s.pool))
        r.posts = self.provider.requests()
        r.suppressed = self.provider.suppressed()
        r.records_flushed = self.records_flushed
        if self.flush_time is not None:
            total, _ = self.provider.attempts_after(self.flush_time, self.flushed_keys)
            if self.ack_time is not None:
                r.resends, r.resent_deliveries = self.provider.attempts_after(self.ack_time, self.flushed_keys)
                r.lost_seconds = self.ack_time - self.flush_time
                r.requests_before_ack = self.requests_at_ack - self.requests_at_flush
                r.requests_while_lost = self.requests_at_ack - self.requests_at_settled
            r.resends_before_ack = total - r.resends
        r.delivered_at_flush = len(self.flushed_keys)
        r.acknowledged = self.ack_time is not None
        r.deduped, r.deduped_unexplained, r.ambiguous_faults = self.provider.deduped(self.flush_time, self.cut)
        if s.provider_outage and self.outage is not None:
            down, back = self.outage
            r.outage_seconds, r.delivered_at_outage = round(back - down, 1), self.delivered_at_outage
            firsts = self.provider.first_delivery_times()
            r.recovery_seconds = round(max((firsts.get(k, back) for k in keys), default=back) - back, 1)
        r.problems = list(self.errors) + verdict(r)
        r.ok = not r.problems
        self.log("verdict", ok=r.ok, problems=r.problems, deliveries=r.deliveries, duplicates=r.duplicates,
                 missing=r.missing, states=r.states, reviews=r.reviews, review_reasons=r.review_reasons,
                 posts=r.posts, faults=r.faults_by_kind, kills=r.kills, deduped=r.deduped,
                 deduped_unexplained=r.deduped_unexplained)


def fault_kinds(s: Scenario) -> tuple[str, ...]:
    """The faults a scenario's provider is given, every kind in turn."""
    return SMTP_FAULTS if s.provider == "smtp" else HTTP_FAULTS


def verdict(r: Result) -> list[str]:
    """What is wrong with a run, from what it measured (``r``) against what its scenario planned: empty
    when it passed. Read from the provider's records and the ledger, never the workers' return values."""
    s = r.scenario
    problems: list[str] = []
    if not r.drained:
        problems.append("the broker queue was not drained")
    if r.split_records:
        problems.append(f"{r.split_records} intents recorded under both their old and their new key")
    if r.stuck:
        problems.append(f"not every record final within {s.deadline:.0f}s: {r.states}")
    problems += _undisturbed(r)
    if s.drill:
        # While the loss stands nothing may reach the provider; after the acknowledgement, copies
        # enqueued before it are sent only with their key (the provider de-duplicates) or parked
        # for review: no duplicate delivery either way, and nothing undelivered outside review.
        if not r.acknowledged:
            problems.append("the loss was never acknowledged")
        if r.resends_before_ack or r.requests_while_lost:
            problems.append(f"{r.requests_while_lost} provider requests ({r.resends_before_ack} for intents "
                            "already delivered) while the ledger was lost and unacknowledged")
        if r.duplicates:
            problems.append(f"{r.duplicates} duplicate deliveries after the acknowledgement")
    elif r.duplicates:
        problems.append(f"{r.duplicates} duplicate deliveries")
    problems += _hidden_copies(r)
    if r.unknown_deliveries:
        problems.append(f"{r.unknown_deliveries} deliveries under keys no intent has")
    if s.provider_outage:
        # Refused at connect, nothing was sent: every intent is retried until the provider is back, none fails.
        if not r.outage_seconds:
            problems.append("the provider was never stopped")
        if r.states.get(State.FAILED.value):
            problems.append(f"{r.states[State.FAILED.value]} intents failed during a provider outage")
    if s.defaults:
        # With the library's defaults: copies of one task id must not multiply, and the intent of a dead holder
        # must settle within what the design allows.
        if r.unexplained_forks:
            problems.append(f"copies multiplied: one task id's messages forked {r.unexplained_forks} times with no "
                            f"kill to explain it ({r.max_lineages} lineages; a storm)")
        if r.worker_kills and not r.killed_executions:
            problems.append("no whole-worker kill cut an execution short: the recovery time measured nothing")
        late = max(r.recoveries, key=lambda rec: rec.over, default=None)
        if late is not None and late.over > 0:
            problems.append(f"an intent cut short by a kill was settled {late.settled_after:.1f} s later, over the "
                            f"{late.allowed:.1f} s the design allows ({r.recovery_design:.1f} s, the broker's queue "
                            f"wait {late.queue_wait:.1f} s, {late.faults} provider faults)")
    open_ = sum(n for st, n in r.states.items() if st not in FINAL and st != "none")
    if open_:
        problems.append(f"{open_} records not final")
    if r.no_record and not s.drill:  # a drill's intents sent in full before the flush have none, rightly
        problems.append(f"{r.no_record} intents without a ledger record")
    if s.keyed:
        if r.missing:
            problems.append(f"{r.missing} intents never delivered")
        if r.deliveries != s.intents:
            problems.append(f"{r.deliveries} deliveries for {s.intents} intents")
    if r.undelivered_not_review:
        problems.append(f"{r.undelivered_not_review} intents neither delivered nor in review (silently lost)")
    return problems


def _undisturbed(r: Result) -> list[str]:
    """The disturbances the scenario planned that did not happen: a run nothing disturbed proves nothing."""
    s = r.scenario
    problems: list[str] = []
    if r.kills < s.kills:
        problems.append(f"{r.kills} of the {s.kills} planned kills happened")
    if s.fault_rate > 0:
        kinds = fault_kinds(s)
        never = [k for k in kinds if not r.faults_by_kind.get(k)]
        if not r.faults:
            problems.append("planned faults never applied: none at all")
        elif never and r.faults >= FAULTS_PER_KIND_FOR_ALL * len(kinds):
            # Kinds are drawn at random: with few faults a kind may miss by chance (a short run applied 2 of 4
            # kinds); past this many per kind, a kind never applied is the injector's fault, not chance.
            problems.append(f"planned faults never applied: {', '.join(never)} ({r.faults} applied in all)")
    if r.ledger_blips < s.ledger_blips:
        problems.append(f"{r.ledger_blips} of the {s.ledger_blips} planned ledger outages happened")
    if s.rotate_secret_at is not None and not r.rotated:
        problems.append("the key secret was never rotated")
    if s.drill and r.records_flushed < max(1, r.delivered_at_flush):
        # Every intent delivered by then had a record: fewer deleted means the ledger was not lost.
        problems.append(f"the flush deleted {r.records_flushed} records when {r.delivered_at_flush} intents "
                        "had been delivered")
    return problems


def _hidden_copies(r: Result) -> list[str]:
    """Copies that reached the provider and that only its de-duplication kept from being a second email:
    each needs a cause the library could not see past (an ambiguous fault on that key, a kill, a copy run
    while another still ran); a library that sent every copy under the same key would pass on
    deliveries alone."""
    s = r.scenario
    problems: list[str] = []
    # A pool child's kill cuts one send short, a whole worker's up to its concurrency.
    allowance = r.child_kills + r.worker_kills * s.concurrency + r.overlapping
    if r.deduped_unexplained > allowance:
        problems.append(f"{r.deduped_unexplained} requests the provider de-duplicated under keys no ambiguous "
                        f"fault hit (kills and overlapping copies explain at most {allowance})")
    explained = r.deduped - r.deduped_unexplained
    if explained > DEDUPED_PER_FAULT * r.ambiguous_faults:
        problems.append(f"{explained} requests the provider de-duplicated after {r.ambiguous_faults} ambiguous "
                        f"faults (at most {DEDUPED_PER_FAULT} each)")
    return problems


def run_scenario(s: Scenario, log_dir: Path) -> Result:
    """Run one scenario end to end; the workers are always reaped. See the module docstring."""
    return Run(s, log_dir).execute()
