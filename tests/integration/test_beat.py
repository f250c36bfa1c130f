"""Digests on beat: slots from the schedule, and two real ``celery beat`` processes with a late tick.

The first tests drive the scheduler, the schedule and the helpers in this process.
The last one runs two beats, each ``-S idemmail_celery.beat:SlotScheduler`` with its
own schedule file and the same ``aligned(seconds=3)`` entry (tests/integration/beatapp.py),
whose fan-out task calls ``send_digest`` for three recipients. The fake provider
does not de-duplicate (``dedupe=False``): every email that reaches it counts, so
only the keys can keep the count at one per (recipient, slot).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab

from idemmail_celery import send_email  # noqa: F401  # registers send_email on every app
from idemmail_celery.beat import (
    SLOT_HEADER,
    SlotMissingError,
    SlotMixin,
    aligned,
    due_time,
    format_slot,
    send_digest,
    slot_of,
)
from idemmail_celery.testing.fake_provider import FakeProvider

from ..conftest import REDIS_URL, service_missing, unique, wait_for
from .conftest import ROOT, Reaper, Sink, stop_group

PERIOD = 3.0
APP = "tests.integration.beatapp"
PARIS = ZoneInfo("Europe/Paris")


def at(*when: int) -> dt.datetime:
    """A moment in Paris (the test apps' timezone)."""
    return dt.datetime(*when, tzinfo=PARIS)  # type: ignore[misc]


def epoch(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc)


class Clock:
    """A settable ``nowfun`` for schedules."""

    def __init__(self, now: dt.datetime) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now


@pytest.fixture
def app() -> Iterator[Celery]:
    a = Celery(unique("beat"), broker=REDIS_URL, set_as_current=False)
    a.conf.update(timezone="Europe/Paris", enable_utc=True, task_default_queue=unique("q"),
                  idemmail_ledger_url=REDIS_URL, idemmail_key_secret="test-secret",
                  idemmail_provider_url="console://", idemmail_default_from="Digests <digest@example.com>")
    yield a
    redis.Redis.from_url(REDIS_URL).delete(a.conf.task_default_queue)
    a.close()


# -- the schedule and the slot, in this process --


def test_aligned_is_due_at_multiples_of_its_period_whenever_beat_started() -> None:
    clock = Clock(epoch(1000.0))
    s = aligned(seconds=300, nowfun=clock)
    assert s.due_after(epoch(601.5)) == epoch(900) == s.due_after(epoch(899.99))
    assert s.due_after(epoch(900)) == epoch(1200)  # strictly after: the run at 900 does not repeat
    assert aligned(seconds=300, offset=60).due_after(epoch(601)) == epoch(660)
    # A tick that is late by more than a period: due now (for 900), next check at the next boundary.
    clock.now = epoch(1250.0)
    assert tuple(s.is_due(epoch(600.2))) == (True, 250.0)
    clock.now = epoch(1150.0)
    assert tuple(s.is_due(epoch(900.2))) == (False, 50.0)
    copy = pickle.loads(pickle.dumps(aligned(seconds=dt.timedelta(minutes=5), offset=7)))  # the schedule file
    assert copy == aligned(seconds=300, offset=7) != aligned(seconds=300)


def test_due_time_of_a_late_crontab_tick_is_the_slot_it_was_due_for(app: Celery) -> None:
    clock = Clock(at(2026, 11, 21, 7, 40))  # beat wakes 40 minutes late
    daily = crontab(hour=7, minute=0, nowfun=clock, app=app)
    entry = ScheduleEntry("digest", "t", last_run_at=at(2026, 11, 20, 7, 0, 2), schedule=daily, app=app)
    due = due_time(entry, app.timezone)
    assert due == at(2026, 11, 21, 7, 0) and due.utcoffset() == dt.timedelta(hours=1)
    assert format_slot(due, "day") == "2026-11-21"  # not the next day, however late, until it is run
    clock.now = at(2026, 11, 22, 6, 59)  # the same entry, still not run, a day later: still that slot
    assert format_slot(due_time(entry, app.timezone), "day") == "2026-11-21"


class MemorySlotScheduler(SlotMixin, Scheduler):  # type: ignore[misc]
    """The mixin on Celery's in-memory scheduler, as a user would put it on theirs."""


def test_slot_mixin_sends_the_due_slot_as_a_header_and_stores_nothing(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(epoch(3605.0))
    app.conf.beat_schedule = {"digest": {"task": "digest", "schedule": aligned(seconds=60, nowfun=clock),
                                         "options": {"headers": {"mine": "1"}}}}

    @app.task(shared=False, name="digest")
    def digest() -> None:
        """Stands for the fan-out."""

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(digest, "apply_async", lambda args, kwargs, **options: sent.append(options))
    scheduler = MemorySlotScheduler(app)
    entry = scheduler.schedule["digest"]
    entry.last_run_at = epoch(3540.5)  # ran for 3540; due at 3600; now it is 3605

    scheduler.apply_entry(entry, producer=None)  # what beat's tick does (it reserved the entry already)
    scheduler.apply_async(scheduler.schedule["digest"], advance=True)  # "run now": reserves, then sends

    slot = "1970-01-01T02:00:00.000+01:00"  # 3600 s after the epoch, in Paris
    assert sent[0]["headers"] == {"mine": "1", "celery_beat_task": True, SLOT_HEADER: slot}
    assert sent[1]["headers"][SLOT_HEADER] == slot  # from before the reserve, not from now
    assert scheduler.schedule["digest"].last_run_at == clock.now  # reserved by the second call
    for e in (entry, scheduler.schedule["digest"]):
        assert SLOT_HEADER not in str(e.options)  # never stored with the entry


class Request:
    """What a task sees as ``self.request``: custom headers arrive as attributes."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def test_slot_of_names_the_slot_from_the_header_else_from_the_explicit_argument() -> None:
    beat = Request(idemmail_slot="2026-11-21T07:00:00.000+01:00")
    assert slot_of(beat, "day") == "2026-11-21"
    assert slot_of(beat, "week") == "2026-W47"
    assert slot_of(beat, "hour") == "2026-11-21T07" and slot_of(beat, "month") == "2026-11"
    assert slot_of(Request(headers={SLOT_HEADER: "2026-12-31T23:59:59.999+01:00"}), "week") == "2026-W53"
    assert slot_of(beat, "day", slot="2026-11-21") == "2026-11-21"  # the same slot twice is fine
    with pytest.raises(ValueError, match="disagrees"):
        slot_of(beat, "day", slot="2026-11-20")
    manual = Request(headers=None)
    assert slot_of(manual, "day", slot="2026-11-20") == "2026-11-20"
    assert slot_of(manual, "week", slot=dt.date(2026, 11, 20)) == "2026-W47"
    for wrong in ("2026-11-20 ", "20/11/2026", "2026-11-20T00"):
        with pytest.raises(ValueError, match="another key"):
            slot_of(manual, "day", slot=wrong)
    with pytest.raises(SlotMissingError):
        slot_of(manual, "day")  # never the wall clock


def test_send_digest_keys_each_recipient_per_slot_and_skips_invalid_addresses(app: Celery) -> None:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    people = ["ann@example.com", "bob@example.com", "not an address"]

    def fan_out(slot: str) -> dict[str, Any]:
        return send_digest(app, slot=slot, recipients=people, subject=lambda to, s: f"Digest {s}",
                           build_body=lambda to, s: {"text": f"{to}: news up to {s}"}, tags={"kind": "digest"})

    first, again, later = fan_out("2026-11-21"), fan_out("2026-11-21"), fan_out("2026-11-22")
    assert first["event_id"] == "digest:2026-11-21" and [i["position"] for i in first["invalid"]] == [2]
    assert first["enqueued"] == again["enqueued"]  # a retried fan-out: the same key for each recipient
    assert len(set(first["enqueued"])) == 2
    assert not set(first["enqueued"]) & set(later["enqueued"])  # the next slot: new keys
    messages = [json.loads(m) for m in redis.Redis.from_url(REDIS_URL).lrange(app.conf.task_default_queue, 0, -1)]
    assert len(messages) == 6 and {m["headers"]["idempotency_key"] for m in messages} == {
        *first["enqueued"], *later["enqueued"]}
    with pytest.raises(SlotMissingError):
        send_digest(app, slot="", recipients=people, subject="s", build_body=lambda to, s: {"text": "t"})


# -- real beat processes --


class CeleryProcess:
    """``celery -A tests.integration.beatapp <args>`` in its own session; stopped by the fixture."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.args, self.env, self.log_path = name, args, env, log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready: bytes) -> CeleryProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", APP, *self.args], cwd=ROOT,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: ready in self.log(), timeout=60)
        return self

    def log(self) -> bytes:
        return self.log_path.read_bytes()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


@pytest.fixture
def celery_process(tmp_path: Path, worker_reaper: Reaper) -> Iterator[Callable[..., CeleryProcess]]:
    started: list[CeleryProcess] = []

    def start(name: str, args: list[str], env: dict[str, str], ready: bytes) -> CeleryProcess:
        p = CeleryProcess(name, args, env, tmp_path)
        started.append(p)
        return p.start(ready)

    yield start
    for p in started:
        if p.proc is not None:
            worker_reaper.stop(p.proc)


def runs(sink: Sink) -> list[dict[str, Any]]:
    return [json.loads(x) for x in sink.r.lrange(sink.k("runs"), 0, -1)]


def slot_time(run: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(run["header"]).timestamp()


def test_two_beats_and_a_late_tick_send_one_digest_per_recipient_per_slot(
    sink: Sink, worker_env: dict[str, str], celery_process: Callable[..., CeleryProcess], tmp_path: Path
) -> None:
    with FakeProvider(dedupe=False) as fake:
        env = {**worker_env, "IDEMMAIL_TEST_PROVIDER": fake.url, "IDEMMAIL_TEST_BEAT_PERIOD": str(PERIOD)}
        celery_process("worker", ["worker", "-P", "prefork", "-c", "4", "--loglevel=INFO", "--without-gossip",
                                  "--without-mingle", "--without-heartbeat", "-n", f"{sink.ns}-beat@%h"],
                       env, b"ready.")
        beats = {
            name: celery_process(f"beat-{name}", ["beat", "-S", "idemmail_celery.beat:SlotScheduler",
                                                  "-s", str(tmp_path / f"schedule-{name}"), "--loglevel=INFO"],
                                 {**env, "IDEMMAIL_TEST_BEAT_ID": name}, b"beat: Starting")
            for name in ("A", "B")
        }

        def slots_by(beat: str) -> set[float]:
            return {slot_time(run) for run in runs(sink) if run["beat"] == beat}

        def b_just_ticked() -> bool:
            # Its run for the slot that began less than half a period ago is in: B sleeps till the next.
            return bool(slots_by("B")) and time.time() - max(slots_by("B")) < PERIOD / 2

        # 1. Both beats tick for the same slot: two fan-outs, one digest per recipient.
        # 2. Stop B right after one of its ticks, across two slot boundaries, then let it go on.
        wait_for(lambda: slots_by("A") & slots_by("B") and b_just_ticked(), timeout=20, interval=0.02)
        stopped_after = max((run for run in runs(sink) if run["beat"] == "B"), key=slot_time)
        beats["B"].signal(signal.SIGSTOP)
        time.sleep(2 * PERIOD + 0.5)
        beats["B"].signal(signal.SIGCONT)
        resumed_at = time.time()

        # B fires late, for the slot it was due for when it stopped (the wall clock is a slot further).
        due_slot = slot_time(stopped_after) + PERIOD
        late = wait_for(lambda: [run for run in runs(sink)
                                 if run["beat"] == "B" and abs(slot_time(run) - due_slot) < 0.01], timeout=10)
        assert isinstance(late, list) and len(late) == 1
        late_run = late[0]
        assert late_run["at"] - due_slot > PERIOD, late_run  # late by more than a whole period
        assert resumed_at - (resumed_at % PERIOD) != due_slot  # a key from the clock would name another slot

        # 3. The next slot after B resumed: both beats tick again, one more digest each.
        wait_for(lambda: {s for s in slots_by("A") & slots_by("B") if s > resumed_at}, timeout=10)
        for p in beats.values():
            p.stop()

        every_run = runs(sink)
        slots = {run["slot"] for run in every_run}
        recipients = {f"{n}.{sink.ns}@example.com" for n in ("ann", "bob", "cat")}
        expected = {(to, f"Digest {s}") for s in slots for to in recipients}
        wait_for(lambda: {(d.recipients[0], d.subject) for d in fake.deliveries()} >= expected, timeout=15)
        time.sleep(1.0)  # any late duplicate would land now
        per_recipient_slot = Counter((d.recipients[0], d.subject) for d in fake.deliveries())

    assert set(per_recipient_slot) == expected
    assert set(per_recipient_slot.values()) == {1}, per_recipient_slot  # never two for one (recipient, slot)
    doubled = [s for s, n in Counter(run["slot"] for run in every_run).items() if n > 1]
    assert len(doubled) >= 2, every_run  # ticks of both beats in one slot, before and after the stop
    # The slot travelled in the app's timezone (Europe/Paris), not UTC.
    header = dt.datetime.fromisoformat(late_run["header"])
    assert header.utcoffset() == header.astimezone(ZoneInfo("Europe/Paris")).utcoffset() != dt.timedelta(0)
    assert late_run["slot"] == header.strftime("%Y-%m-%dT%H:%M:%S")
