"""Scheduled digests: one email per recipient per schedule slot, however many beats fire it.

In your project the digest is a crontab entry and beat runs with the slot-aware scheduler::

    app.conf.beat_scheduler = "idemmail_celery.beat:SlotScheduler"    # or: celery beat -S ...
    app.conf.beat_schedule = {
        "daily-digest": {"task": "digests.daily_digest", "schedule": crontab(hour=7, minute=0)},
    }

    @app.task(bind=True, name="digests.daily_digest")
    def daily_digest(self, slot=None):
        day = slot_of(self.request, "day", slot=slot)    # "2026-11-21": the day the entry was due
        return send_digest(app, slot=day, recipients=subscribers(), subject=f"Your digest for {day}",
                           build_body=lambda to, day: {"html": render_digest(to, day)})

    # A manual re-run names its slot, and resends to nobody who already has it:
    daily_digest.delay(slot="2026-11-21")

This script runs the same thing fast and on its own: the entry is ``aligned(seconds=2)``
(due at every even second on every beat, so the slots are seconds), and **two** beat
services fire it, each with its own schedule file, as two beat processes would (here as
threads of this process). An embedded worker thread runs the fan-outs and ``send_email``
against a fake provider that does *not* de-duplicate. At the end a manual re-run of the
first slot shows it sends nothing new. ``RESULT: OK`` when every recipient got exactly
one digest per slot.

Options: ``--broker`` (default ``memory://``), ``--ledger`` (default a temporary SQLite
file), ``--seconds`` to run the beats (default 7), ``--prefix`` for queue and ledger names.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import EmbeddedService
from celery.contrib.testing.worker import start_worker

from idemmail_celery import send_email  # noqa: F401  # registers send_email on the app
from idemmail_celery.beat import SlotScheduler, aligned, send_digest, slot_of
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

SUBSCRIBERS = ["ann@example.com", "bob@example.com", "cat@example.com"]
EVERY = 2.0

fanouts: Counter[str] = Counter()  # slot -> fan-out runs (one per beat that fired it)
_lock = threading.Lock()


def make_app(broker: str, ledger_url: str, provider_url: str, prefix: str) -> Celery:
    app = Celery("digest_example", broker=broker)
    app.conf.update(
        timezone="Europe/Paris",  # slots are named in the app's timezone
        task_default_queue=f"{prefix}digests",
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_transport_options={"polling_interval": 0.1},  # memory:// polls; a demo should not wait 1 s
        beat_schedule={
            "digest": {"task": "digests.daily_digest", "schedule": aligned(seconds=EVERY)},
        },
        idemmail_ledger_url=ledger_url,
        idemmail_ledger_options={"table": f"{prefix}idemmail_ledger"} if not ledger_url.startswith("redis")
        else {"prefix": f"{prefix}ledger"},
        idemmail_key_secret="example-secret-do-not-use-in-production",
        idemmail_provider_url=provider_url,
        idemmail_provider_api_key=DEFAULT_API_KEY,
        idemmail_default_from="Digests <digest@example.com>",
    )

    @app.task(bind=True, name="digests.daily_digest")
    def daily_digest(self: Any, slot: str | None = None) -> dict[str, Any]:
        # "second" because this demo's slots are two seconds long; a daily digest says "day".
        the_slot = slot_of(self.request, "second", slot=slot)
        with _lock:
            fanouts[the_slot] += 1
        return send_digest(app, slot=the_slot, recipients=SUBSCRIBERS, subject=lambda to, s: f"Digest {s}",
                           build_body=lambda to, s: {"text": f"Hello {to}, here is what happened up to {s}."})

    return app


def expected() -> set[tuple[str, str]]:
    """(recipient, subject) of every digest due: one per recipient per slot fanned out so far."""
    with _lock:
        return {(to, f"Digest {slot}") for slot in fanouts for to in SUBSCRIBERS}


def delivered(fake: FakeProvider) -> set[tuple[str, str]]:
    return {(d.recipients[0], d.subject) for d in fake.deliveries()}


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--broker", default="memory://")
    parser.add_argument("--ledger", help="ledger URL (default: a temporary SQLite file)")
    parser.add_argument("--seconds", type=float, default=7.0, help="how long the two beats run")
    parser.add_argument("--prefix", help="prefix for the queue and ledger names (tests isolate runs)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="digest-example-"))
    ledger_url = args.ledger or f"sqlite:///{workdir / 'ledger.sqlite3'}"
    prefix = args.prefix or f"ex{uuid.uuid4().hex[:6]}_"

    with FakeProvider(dedupe=False) as fake:
        app = make_app(args.broker, ledger_url, fake.url, prefix)
        with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING", shutdown_timeout=30):
            beats = [EmbeddedService(app, thread=True, scheduler_cls=SlotScheduler,
                                     schedule_filename=str(workdir / f"beat-{name}")) for name in "AB"]
            for beat in beats:
                beat.start()
            time.sleep(args.seconds)
            for beat in beats:
                beat.stop()
            with _lock:
                first_slot = min(fanouts)
                runs_before = fanouts[first_slot]
            print(f"beats stopped; fan-out runs per slot: {dict(sorted(fanouts.items()))}")

            # A person re-runs the first slot by hand: it must name the slot.
            app.tasks["digests.daily_digest"].delay(slot=first_slot)
            # A beat may have fired once more as it stopped: every slot fanned out by the end counts.
            settled = wait_until(lambda: fanouts[first_slot] > runs_before and delivered(fake) >= expected(), 30)
            time.sleep(1.0)  # room for a (wrong) extra delivery, or a last fan-out, to show up
            settled = settled and wait_until(lambda: delivered(fake) >= expected(), 30)
        per_slot = Counter((d.recipients[0], d.subject) for d in fake.deliveries())

    doubled = sorted(slot for slot, runs in fanouts.items() if runs > 1)
    print(f"manual re-run of {first_slot}: fan-out runs now {fanouts[first_slot]}, emails for that slot "
          f"{sum(n for (_, subject), n in per_slot.items() if subject.endswith(first_slot))}")
    for (to, subject), n in sorted(per_slot.items(), key=lambda item: (item[0][1], item[0][0])):
        print(f"{subject}  {to}: {n}")
    print(f"slots fired by more than one run (two beats, or the manual re-run): {doubled}")
    ok = settled and set(per_slot) == expected() and set(per_slot.values()) == {1} and len(doubled) >= 1
    print(f"{len(fanouts)} slots x {len(SUBSCRIBERS)} recipients, {sum(per_slot.values())} digests delivered")
    print("RESULT: OK" if ok else "RESULT: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
