"""``make upgrade-check``: what an earlier release left waiting is sent once by this code, through real workers killed
on the way.

Until a second release exists, the earlier release is its golden fixtures (``tests/golden/v1/``: messages and outbox
rows exactly as 0.1.0 writes them). For each ledger (Redis, PostgreSQL), on RabbitMQ, against the fake provider
(it de-duplicates on ``Idempotency-Key``, as the HTTP providers do, and answers after 1 s, so that kills land mid-send):

1. every golden ``send_email`` message is published ``--copies`` times as it is (its sealed headers unchanged: what
   waits in a broker across an upgrade), and every golden outbox row is written to a fresh outbox table and relayed
   twice (a relay that died before its commit publishes again);
2. workers of this code take them, and are SIGKILLed ``--kills`` times (main process and pool), each time 0.3 s after a
   new request reached the provider, and restarted;
3. once the queue is empty and every intent's record is final, the check counts, per intent (its recipients and
   subject: a second key for one intent is a duplicate too): **duplicates** (delivered more than once), **lost**
   (never delivered), **stranded** (a record left ``claimed``, or under a key no fixture names).

Prints a Markdown table; exits 1 if any count is not 0. About a minute per ledger.

    python -m upgrade.check [--copies 3] [--kills 3] [--ledgers redis,postgresql]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from chaos.procs import WorkerProcess, install_signal_handlers, reap_all, wait_until
from tests.conftest import drop_ledger

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "tests" / "golden" / "v1"
BROKER = os.environ.get("IDEMMAIL_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
LEDGERS = {"redis": os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0"),
           "postgresql": os.environ.get("IDEMMAIL_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")}
SEND_EMAIL = "idemmail_celery.send_email"


def intent_of(recipients: Any, subject: str) -> tuple[str, str]:
    """An intent as the provider sees it: its recipients (sorted, lower case) and subject."""
    listed = [recipients] if isinstance(recipients, str) else list(recipients)
    return ",".join(sorted(str(r).lower().rsplit("<", 1)[-1].rstrip(">") for r in listed)), subject


def run(ledger_name: str, copies: int, kills: int, log_dir: Path) -> dict[str, Any]:
    """One ledger's check; its row of the table."""
    from idemmail_celery.ledger import State, from_url
    from idemmail_celery.outbox import create_outbox_table, relay
    from idemmail_celery.testing.fake_provider import FakeProvider

    ns = f"upgrade_{uuid.uuid4().hex[:8]}"
    ledger_url = LEDGERS[ledger_name]
    provider = FakeProvider(latency=1.0)
    provider.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "UPGRADE_BROKER": BROKER, "UPGRADE_LEDGER": ledger_url,
           "UPGRADE_NS": ns, "UPGRADE_PROVIDER": provider.url, "UPGRADE_LEASE": "3"}
    os.environ.update({k: v for k, v in env.items() if k.startswith("UPGRADE_")})
    sys.modules.pop("upgrade.workerapp", None)  # made again for this ledger (the module reads the environment)
    app = importlib.import_module("upgrade.workerapp").app
    messages = [m for m in json.loads((V1 / "messages.json").read_text()) if m["task"] == SEND_EMAIL]
    rows = json.loads((V1 / "outbox_rows.json").read_text())
    intents = {intent_of(m["kwargs"]["to"], m["kwargs"]["subject"]) for m in messages}
    keys = {m["key"] for m in messages} | {r["intent_key"] for r in rows}
    worker = WorkerProcess(f"upgrade-{ledger_name}", "upgrade.workerapp", ["-P", "prefork", "-c", "2"], env, log_dir)
    ledger = from_url(ledger_url, **({"prefix": ns} if ledger_url.startswith("redis") else {"table": ns}))
    engine = sa.create_engine(f"sqlite:///{log_dir / f'outbox-{ns}.sqlite3'}")
    started = time.monotonic()
    killed = 0
    try:
        worker.start()
        task = app.tasks[SEND_EMAIL]
        for m in messages:  # as the earlier release left them in the broker: sealed headers, unchanged
            for _ in range(copies):
                task.apply_async(m["args"], m["kwargs"], headers=dict(m["headers"]))
        table = create_outbox_table(engine)
        with engine.begin() as conn:
            for row in rows:
                conn.execute(sa.insert(table).values(**{
                    k: sa.func.datetime(v) if k.endswith("_at") and v else v for k, v in row.items()}))
        relay(engine, app)
        with engine.begin() as conn:  # a relay that died before its commit: the rows are published again
            conn.execute(sa.update(table).values(state="pending"))
        relay(engine, app)
        for _ in range(kills):  # each kill lands mid-send: after a new request reached the provider, before its answer
            seen = provider.attempt_count()
            if not wait_until(lambda seen=seen: provider.attempt_count() > seen, timeout=30):
                break  # nothing left to send: every intent settled before this kill
            time.sleep(0.3)
            worker.kill()
            killed += 1
            worker.start()

        def settled() -> bool:
            records = list(ledger.iter_records())
            return len(records) >= len(keys) and all(r.state.is_final for r in records)

        wait_until(settled, timeout=180, interval=0.5)
        time.sleep(2)  # copies still queued find the final records and only answer "duplicate"
        records = list(ledger.iter_records())
        delivered = Counter(intent_of(list(d.recipients), d.subject) for d in provider.deliveries())
    finally:
        worker.stop()
        provider.stop()
        engine.dispose()
        with app.connection_for_write() as conn:  # this run's queue goes with it (copies left are duplicates)
            conn.default_channel.queue_delete(app.conf.task_default_queue)
    stranded = [r for r in records if r.state is State.CLAIMED or r.key not in keys]
    out = {"ledger": ledger_name, "intents": len(intents), "messages": len(messages) * copies + 2 * len(rows),
           "kills": killed, "deliveries": sum(delivered.values()),
           "duplicates": sum(n - 1 for n in delivered.values() if n > 1),
           "lost": sum(1 for i in intents if not delivered[i]), "stranded": len(stranded),
           "states": dict(Counter(r.state.value for r in records)), "seconds": round(time.monotonic() - started)}
    drop_ledger(ledger)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = ["ledger", "intents", "messages", "kills", "deliveries", "duplicates", "lost", "stranded", "states",
            "seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]) for h in head) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=3, help="copies of each golden message published")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs of the worker, each followed by a restart")
    parser.add_argument("--ledgers", default="redis,postgresql")
    args = parser.parse_args(argv)
    install_signal_handlers()
    sys.path.insert(0, str(ROOT))
    rows = []
    try:
        logs = Path(tempfile.mkdtemp(prefix="upgrade-check-"))  # the workers' logs, kept for a failure
        for name in args.ledgers.split(","):
            rows.append(run(name, args.copies, args.kills, logs))
    finally:
        reap_all()
    print(table(rows))
    bad = [r for r in rows if r["duplicates"] or r["lost"] or r["stranded"]]
    if bad:
        print(f"upgrade-check: FAILED on {', '.join(r['ledger'] for r in bad)}; the workers' logs: {logs}",
              file=sys.stderr)
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    print("upgrade-check: 0 duplicates, 0 lost, 0 stranded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
