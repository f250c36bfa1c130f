"""``make upgrade-check``: intents of the previous release and of this code sent once, through real workers of both
killed on the way, with upgrades and a rollback.

Two modes, each run per ledger (Redis, PostgreSQL), on RabbitMQ, against the fake provider (it de-duplicates on
``Idempotency-Key``, as the HTTP providers do, and answers after 1 s, so that kills land mid-send):

``fixtures``
    The golden fixtures (``tests/golden/v1/``: messages and outbox rows exactly as 0.1.0 writes them): every
    ``send_email`` message is published ``--copies`` times as it is (its sealed headers unchanged), every outbox row is
    relayed twice (a relay that died before its commit publishes again); one worker of this code takes them and is
    SIGKILLed ``--kills`` times.
``release``
    The newest release older than this code (:mod:`upgrade.release`: recorded in ``upgrade/releases.json``, installed
    in ``.upgrade/<version>/``). ``--intents`` intents, in three batches, one per phase; each intent is enqueued
    ``--copies`` times by the release's caller (:mod:`upgrade.caller`, the release's ``send_email.delay``) and as
    often by this code's. Two workers (prefork, one child each) take them:

    1. *old*: the release's workers alone;
    2. *upgrade*: one is replaced by a worker of this code, the batch is enqueued, then the other is replaced;
    3. *rollback*: the same back, this code's workers replaced by the release's.

    In each phase the batch goes in as many parts as ``--phase-kills``, each part followed by a SIGKILL (main process
    and pool) of the running workers in turn, 0.3 s after a new request reached the provider, the killed worker
    restarted at its own version.

Each mode waits until the queue is idle and every intent's record is final, then counts per intent (its recipients
and subject: a second key for one intent is a duplicate too): **duplicates** (delivered more than once), **lost**
(never delivered), **stranded** (a record left ``claimed``, or under a key the earlier release did not derive).
Prints a Markdown table (a row per ledger and mode); exits 1 if any count is not 0, 2 if the release cannot be
installed.

    python -m upgrade.check [--against both|fixtures|release] [--intents 24] [--copies 3] [--kills 3]
                            [--phase-kills 2] [--ledgers redis,postgresql]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from chaos.procs import WorkerProcess, install_signal_handlers, reap_all, wait_until
from upgrade.release import Release, ReleaseError, current_version, install, previous, recorded

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "tests" / "golden" / "v1"
CALLER = ROOT / "upgrade" / "caller.py"
BROKER = os.environ.get("IDEMMAIL_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
LEDGERS = {"redis": os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0"),
           "postgresql": os.environ.get("IDEMMAIL_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")}
SEND_EMAIL = "idemmail_celery.send_email"
AGAINST = ("both", "fixtures", "release")
PHASES = ("old", "upgrade", "rollback")


def intent_of(recipients: Any, subject: str) -> tuple[str, str]:
    """An intent as the provider sees it: its recipients (sorted, lower case) and subject."""
    listed = [recipients] if isinstance(recipients, str) else list(recipients)
    return ",".join(sorted(str(r).lower().rsplit("<", 1)[-1].rstrip(">") for r in listed)), subject


def count(intents: Iterable[tuple[str, str]], keys: Iterable[str], deliveries: Iterable[Any],
          records: Iterable[Any]) -> dict[str, Any]:
    """The verdict of one run: ``deliveries`` (the provider's, each with ``recipients`` and ``subject``) counted per
    intent, against ``records`` (the ledger's, each with ``key`` and ``state``) and the ``keys`` they may be under."""
    intents, keys, records = set(intents), set(keys), list(records)
    delivered = Counter(intent_of(list(d.recipients), d.subject) for d in deliveries)
    stranded = [r for r in records if _state(r) == "claimed" or r.key not in keys]
    return {"deliveries": sum(delivered.values()),
            "duplicates": sum(n - 1 for n in delivered.values() if n > 1),
            "lost": sum(1 for i in intents if not delivered[i]), "stranded": len(stranded),
            "states": dict(sorted(Counter(_state(r) for r in records).items()))}


def _state(record: Any) -> str:
    return str(getattr(record.state, "value", record.state))


class Stage:
    """One ledger and mode: a namespace of its own (ledger prefix or table, queue), a fake provider, this code's app
    and the environment every worker and caller of the run shares."""

    def __init__(self, ledger_name: str, mode: str, log_dir: Path) -> None:
        from idemmail_celery.ledger import from_url
        from idemmail_celery.testing.fake_provider import FakeProvider

        self.ledger_name, self.mode, self.log_dir = ledger_name, mode, log_dir
        self.ns = f"upgrade_{uuid.uuid4().hex[:8]}"
        ledger_url = LEDGERS[ledger_name]
        self.provider = FakeProvider(latency=1.0)
        self.provider.start()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "UPGRADE_BROKER": BROKER, "UPGRADE_LEDGER": ledger_url,
                    "UPGRADE_NS": self.ns, "UPGRADE_PROVIDER": self.provider.url, "UPGRADE_LEASE": "3"}
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("UPGRADE_")})
        sys.modules.pop("upgrade.workerapp", None)  # made again for this run (the module reads the environment)
        self.app = importlib.import_module("upgrade.workerapp").app
        self.ledger = from_url(ledger_url, **({"prefix": self.ns} if ledger_url.startswith("redis") else
                                              {"table": self.ns}))
        self.started = time.monotonic()
        self.kills = 0
        self.made = 0

    def worker(self, release: Release | None = None, concurrency: int = 2) -> WorkerProcess:
        """A worker of this code, or of ``release`` (its Python, its source first on the path), not yet started."""
        self.made += 1
        name = f"upgrade-{self.ledger_name}-{self.mode}-{release.version if release else 'new'}-{self.made}"
        args = ["-P", "prefork", "-c", str(concurrency)]
        if release is None:
            return WorkerProcess(name, "upgrade.workerapp", args, self.env, self.log_dir)
        return WorkerProcess(name, "upgrade.workerapp", args, {**self.env, **release.env()}, self.log_dir,
                             python=release.python, cwd=release.src)

    def kill_mid_send(self, worker: WorkerProcess, keys: set[str]) -> bool:
        """SIGKILL ``worker`` 0.3 s after a new request reached the provider, and start it again; False (no kill) when
        every one of ``keys`` is settled first, or no request comes within 30 s."""
        seen = self.provider.attempt_count()
        wait_until(lambda: self.provider.attempt_count() > seen or self.settled(keys), timeout=30, interval=0.1)
        if self.provider.attempt_count() <= seen:
            return False
        time.sleep(0.3)
        worker.kill()
        self.kills += 1
        worker.start()
        return True

    def settled(self, keys: set[str]) -> bool:
        """Has every one of ``keys`` a record, and is every record final?"""
        records = list(self.ledger.iter_records())
        return len(records) >= len(keys) and all(r.state.is_final for r in records)

    def settle(self, keys: set[str]) -> tuple[list[Any], list[Any]]:
        """Once every key has a final record: the ledger's records and the provider's deliveries."""
        wait_until(lambda: self.settled(keys), timeout=180, interval=0.5)
        time.sleep(2)  # copies still queued find the final records and only answer "duplicate"
        return list(self.ledger.iter_records()), self.provider.deliveries()

    def close(self) -> None:
        from tests.conftest import drop_ledger

        self.provider.stop()
        with self.app.connection_for_write() as conn:  # this run's queue goes with it (copies left are duplicates)
            conn.default_channel.queue_delete(self.app.conf.task_default_queue)
        drop_ledger(self.ledger)

    def row(self, mode: str, intents: set[tuple[str, str]], keys: set[str], messages: int,
            records: list[Any], deliveries: list[Any]) -> dict[str, Any]:
        return {"ledger": self.ledger_name, "mode": mode, "intents": len(intents), "messages": messages,
                "kills": self.kills, **count(intents, keys, deliveries, records),
                "seconds": round(time.monotonic() - self.started)}


def run_fixtures(ledger_name: str, copies: int, kills: int, log_dir: Path) -> dict[str, Any]:
    """The fixtures mode on one ledger; its row of the table."""
    from idemmail_celery.outbox import create_outbox_table, relay

    stage = Stage(ledger_name, "fixtures", log_dir)
    messages = [m for m in json.loads((V1 / "messages.json").read_text()) if m["task"] == SEND_EMAIL]
    rows = json.loads((V1 / "outbox_rows.json").read_text())
    intents = {intent_of(m["kwargs"]["to"], m["kwargs"]["subject"]) for m in messages}
    keys = {m["key"] for m in messages} | {r["intent_key"] for r in rows}
    worker = stage.worker()
    engine = sa.create_engine(f"sqlite:///{log_dir / f'outbox-{stage.ns}.sqlite3'}")
    try:
        worker.start()
        task = stage.app.tasks[SEND_EMAIL]
        for m in messages:  # as the earlier release left them in the broker: sealed headers, unchanged
            for _ in range(copies):
                task.apply_async(m["args"], m["kwargs"], headers=dict(m["headers"]))
        table = create_outbox_table(engine)
        with engine.begin() as conn:
            for row in rows:
                conn.execute(sa.insert(table).values(**{
                    k: sa.func.datetime(v) if k.endswith("_at") and v else v for k, v in row.items()}))
        relay(engine, stage.app)
        with engine.begin() as conn:  # a relay that died before its commit: the rows are published again
            conn.execute(sa.update(table).values(state="pending"))
        relay(engine, stage.app)
        for _ in range(kills):  # each kill lands mid-send: after a new request reached the provider, before its answer
            if not stage.kill_mid_send(worker, keys):
                break  # nothing left to send: every intent settled before this kill
        records, deliveries = stage.settle(keys)
    finally:
        worker.stop()
        engine.dispose()
        stage.close()
    return stage.row("fixtures v1", intents, keys, len(messages) * copies + 2 * len(rows), records, deliveries)


def calls_for(intents: int, ns: str) -> list[dict[str, Any]]:
    """The ``send_email`` calls of the release mode, one per intent."""
    return [{"to": f"user{i}@example.com", "subject": f"Upgrade check {ns} #{i}", "text": f"Message {i}",
             "event_id": f"{ns}-{i}"} for i in range(intents)]


def batches(calls: list[Any], parts: int = len(PHASES)) -> list[list[Any]]:
    """``calls`` cut into ``parts`` batches of nearly equal size, in order."""
    return [calls[p * len(calls) // parts:(p + 1) * len(calls) // parts] for p in range(parts)]


def enqueue_release(release: Release, stage: Stage, calls: list[dict[str, Any]], copies: int) -> list[str]:
    """``calls`` enqueued ``copies`` times each by the release's own code (:mod:`upgrade.caller`); their keys."""
    done = subprocess.run(
        [str(release.python), str(CALLER)], input=json.dumps([{"kwargs": c, "copies": copies} for c in calls]),
        env={**stage.env, **release.env()}, cwd=release.src, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the release's caller failed:\n{done.stderr}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if answer["version"] != release.version:
        raise RuntimeError(f"the release's caller ran version {answer['version']} ({answer['module']}), "
                           f"not {release.version}")
    return list(answer["keys"])


def enqueue_current(stage: Stage, calls: list[dict[str, Any]], copies: int) -> list[str]:
    """``calls`` enqueued ``copies`` times each by this code (``send_email.delay``); their keys."""
    task = stage.app.tasks[SEND_EMAIL]
    for call in calls:
        for _ in range(copies):
            task.delay(**call)
    return [task.intent_key(**call) for call in calls]


def run_release(release: Release, ledger_name: str, intents: int, copies: int, phase_kills: int,
                log_dir: Path) -> dict[str, Any]:
    """The release mode on one ledger (its three phases); its row of the table."""
    stage = Stage(ledger_name, "release", log_dir)
    calls = calls_for(intents, stage.ns)
    keys: set[str] = set()  # the keys the release derives: what an intent's record must be under
    slots = [stage.worker(release, concurrency=1), stage.worker(release, concurrency=1)]

    def enqueue(batch: list[dict[str, Any]], first: str) -> None:
        release_side = lambda: keys.update(enqueue_release(release, stage, batch, copies))  # noqa: E731
        current_side = lambda: enqueue_current(stage, batch, copies)  # noqa: E731
        for side in ((release_side, current_side) if first == "release" else (current_side, release_side)):
            side()

    def replace(slot: int, by: Release | None) -> None:
        fresh = stage.worker(by, concurrency=1).start()
        slots[slot].stop()
        slots[slot] = fresh

    def enqueue_and_kill(batch: list[dict[str, Any]], first: str) -> None:
        """The batch in as many parts as the phase has kills, each part followed by its kill (fresh work for each)."""
        for k, part in enumerate(batches(batch, max(1, phase_kills))):
            if part:
                enqueue(part, first)
            if k < phase_kills:
                stage.kill_mid_send(slots[k % len(slots)], keys)

    try:
        for w in slots:
            w.start()
        old, upgrade, rollback = batches(calls)
        enqueue_and_kill(old, first="release")  # 1. the release's workers alone
        replace(0, None)  # 2. a rolling upgrade: side by side, then this code's alone
        enqueue_and_kill(upgrade, first="release")
        replace(1, None)
        replace(0, release)  # 3. a rollback: side by side, then the release's alone
        enqueue_and_kill(rollback, first="current")
        replace(1, release)
        records, deliveries = stage.settle(keys)
    finally:
        for w in slots:
            w.stop()
        stage.close()
    return stage.row(f"release {release.version}", {intent_of(c["to"], c["subject"]) for c in calls}, keys,
                     2 * copies * len(calls), records, deliveries)


def table(rows: list[dict[str, Any]]) -> str:
    head = ["ledger", "mode", "intents", "messages", "kills", "deliveries", "duplicates", "lost", "stranded", "states",
            "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]) for h in head) + " |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--against", choices=AGAINST, default="both",
                        help="the golden fixtures, the previous release's workers and callers, or both (the default)")
    parser.add_argument("--intents", type=int, default=24, help="intents of the release mode (three batches)")
    parser.add_argument("--copies", type=int, default=3, help="copies of each message (per version, in release mode)")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs of the fixtures mode's worker")
    parser.add_argument("--phase-kills", type=int, default=2, help="SIGKILLs in each phase of the release mode")
    parser.add_argument("--ledgers", default="redis,postgresql")
    args = parser.parse_args(argv)
    unknown = set(args.ledgers.split(",")) - set(LEDGERS)
    if unknown:
        parser.error(f"unknown ledger {', '.join(sorted(unknown))} (known: {', '.join(LEDGERS)})")
    for name in ("intents", "copies", "kills", "phase_kills"):
        if getattr(args, name) < (1 if name in ("intents", "copies") else 0):
            parser.error(f"--{name.replace('_', '-')} must be at least {1 if name in ('intents', 'copies') else 0}")
    if args.intents < len(PHASES) and args.against != "fixtures":
        parser.error(f"--intents must be at least {len(PHASES)} (a batch per phase)")
    return args


def modes(against: str, record: dict[str, dict[str, str]], current: str) -> tuple[bool, Release | None, str]:
    """What to run: the fixtures mode or not, the release (None: no release mode) and a message for the reader."""
    release = None if against == "fixtures" else previous(record, current)
    if against != "fixtures" and release is None:
        say = f"upgrade-check: no release older than {current} in upgrade/releases.json"
        if against == "release":
            raise ReleaseError(say[len("upgrade-check: "):])
        return True, None, say + ": the golden fixtures alone"
    return against != "release", release, ""


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        fixtures, release, say = modes(args.against, recorded(), current_version())
        if say:
            print(say)
        if release is not None:
            install(release)
    except ReleaseError as exc:
        print(f"upgrade-check: {exc}", file=sys.stderr)
        return 2
    install_signal_handlers()
    sys.path.insert(0, str(ROOT))
    rows = []
    logs = Path(tempfile.mkdtemp(prefix="upgrade-check-"))  # the workers' logs, kept for a failure
    try:
        for name in args.ledgers.split(","):
            if fixtures:
                rows.append(run_fixtures(name, args.copies, args.kills, logs))
            if release is not None:
                rows.append(run_release(release, name, args.intents, args.copies, args.phase_kills, logs))
    finally:
        reap_all()
    print(table(rows))
    bad = [r for r in rows if r["duplicates"] or r["lost"] or r["stranded"]]
    if bad:
        print(f"upgrade-check: FAILED on {', '.join(r['ledger'] + ' ' + r['mode'] for r in bad)}; the workers' logs: "
              f"{logs}", file=sys.stderr)
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    print("upgrade-check: 0 duplicates, 0 lost, 0 stranded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
