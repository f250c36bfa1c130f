"""The Celery app behind ``make demo``: no servers, everything in files under ``.demo/``.

* broker: kombu's ``filesystem://`` transport (one folder is both "in" and "out");
* result backend: Celery's ``file://`` backend;
* ledger: SQLite (``sqlite:///.demo/ledger.sqlite3``).

Run a worker by hand with ``PYTHONPATH=. celery -A examples.demo_app worker -P prefork -c 2``.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import worker_ready

from idemmail_celery import IdempotentTask

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / ".demo"
BROKER_DIR = DEMO_DIR / "broker"
PROCESSED_DIR = DEMO_DIR / "broker-processed"
CONTROL_DIR = DEMO_DIR / "broker-control"
RESULTS_DIR = DEMO_DIR / "results"
LEDGER_URL = f"sqlite:///{DEMO_DIR / 'ledger.sqlite3'}"
OUTBOX = DEMO_DIR / "outbox.jsonl"
#: While this file exists, the next send dies (SIGKILL) right after writing to the outbox.
CRASH_FLAG = DEMO_DIR / "crash-after-send"
#: Touched when the worker is ready to consume.
READY_FLAG = DEMO_DIR / "worker.ready"
LEASE_SECONDS = 3

for folder in (BROKER_DIR, PROCESSED_DIR, CONTROL_DIR, RESULTS_DIR):
    folder.mkdir(parents=True, exist_ok=True)

app = Celery("idemmail_demo", broker="filesystem://", backend=f"file://{RESULTS_DIR}")
app.conf.update(
    broker_transport_options={
        "data_folder_in": str(BROKER_DIR),
        "data_folder_out": str(BROKER_DIR),
        "store_processed": True,  # keep consumed messages under .demo/, not in /tmp
        "processed_folder": str(PROCESSED_DIR),
        "control_folder": str(CONTROL_DIR),
        "polling_interval": 0.1,
    },
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,  # no pidbox: the demo never inspects the worker
    worker_lost_wait=1.0,  # notice a killed pool process after 1 s, not 10 s
    # the guarantee's settings
    idemmail_ledger_url=LEDGER_URL,
    idemmail_key_secret="demo-secret-do-not-use-in-production",
    idemmail_lease_seconds=LEASE_SECONDS,  # short, so the crash scene resolves in seconds
    idemmail_inflight_backoff=0.3,
    idemmail_inflight_backoff_max=1.0,
)


@app.task(base=IdempotentTask, bind=True, idempotency_key=("to", "order_id"))
def send_receipt(self: IdempotentTask, to: str, order_id: int, body: str) -> dict[str, Any]:
    """'Send' a receipt: append one JSON line to the outbox (think SMTP: the key cannot travel)."""
    key = self.request.idempotency_key
    message_id = f"<{uuid.uuid4().hex[:12]}@demo.invalid>"
    line = json.dumps({"key": key, "to": to, "order_id": order_id, "message_id": message_id, "pid": os.getpid()})
    with OUTBOX.open("a", encoding="utf-8") as outbox:
        outbox.write(line + "\n")
    try:
        CRASH_FLAG.unlink()
    except FileNotFoundError:
        pass
    else:
        # The side effect happened and the claim is held: die before the ledger hears of it.
        os.kill(os.getpid(), signal.SIGKILL)
    return {"message_id": message_id}


@worker_ready.connect
def _announce_ready(**_: Any) -> None:
    READY_FLAG.touch()
