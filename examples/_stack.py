"""What the examples share: a Celery app configured from the environment, and a worker subprocess.

The environment, as ``compose.yaml`` sets it:

* ``CELERY_BROKER_URL``, ``CELERY_RESULT_BACKEND`` (Celery reads these itself), and
  ``CELERY_TASK_DEFAULT_QUEUE``;
* ``IDEMMAIL_<SETTING>`` for the library's settings: ``IDEMMAIL_LEDGER_URL`` becomes
  ``app.conf.idemmail_ledger_url``. A value starting with ``{`` or ``[`` is JSON
  (``IDEMMAIL_LEDGER_OPTIONS={"prefix": "shop"}``), ``true``/``false`` a boolean; anything
  else is a string.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from celery import Celery

ROOT = Path(__file__).resolve().parent.parent
LOCAL_REDIS = "redis://127.0.0.1:6379/0"


def configure_from_env(app: Celery, environ: Mapping[str, str] = os.environ) -> Celery:
    """Apply ``CELERY_TASK_DEFAULT_QUEUE`` and every ``IDEMMAIL_*`` variable of ``environ`` to ``app.conf``."""
    if environ.get("CELERY_TASK_DEFAULT_QUEUE"):
        app.conf.task_default_queue = environ["CELERY_TASK_DEFAULT_QUEUE"]
    for name, value in environ.items():
        if name.startswith("IDEMMAIL_"):
            app.conf[name.lower()] = _setting(value)
    return app


def _setting(value: str) -> Any:
    """JSON objects and lists, ``true``/``false`` as booleans; anything else stays a string."""
    if value[:1] in ("{", "["):
        return json.loads(value)
    if value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def celery_from_env(name: str, **defaults: Any) -> Celery:
    """A Celery app for an example: ``defaults`` first, then the environment; Redis on loopback if unset."""
    app = Celery(name, broker=os.environ.get("CELERY_BROKER_URL", LOCAL_REDIS),
                 backend=os.environ.get("CELERY_RESULT_BACKEND", LOCAL_REDIS))
    app.conf.update(
        task_serializer="json", result_serializer="json", accept_content=["json"],
        broker_connection_retry_on_startup=True,
        worker_send_task_events=True, task_send_sent_event=True,  # Flower sees every task
        idemmail_ledger_url=LOCAL_REDIS.replace("/0", "/1"),
        **defaults,
    )
    return configure_from_env(app)


@contextlib.contextmanager
def celery_worker(app: str, env: Mapping[str, str], *, log: Path, args: tuple[str, ...] = ("-P", "solo"),
                  timeout: float = 60.0) -> Iterator[subprocess.Popen[bytes]]:
    """``celery -A app worker`` in a subprocess of its own session with ``env``; stopped (SIGTERM) on exit."""
    cmd = [sys.executable, "-m", "celery", "-A", app, "worker", "--loglevel=INFO", "--without-gossip",
           "--without-mingle", "--without-heartbeat", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while b"ready." not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the worker did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


def agent_env(prefix: str, provider_url: str, api_key: str) -> dict[str, str]:
    """The worker's environment for an agent example: queue, ledger prefix and CRM list under ``prefix``, the
    email API at ``provider_url``, and a short in-flight backoff (a call asked again waits less for the first)."""
    return {"CELERY_TASK_DEFAULT_QUEUE": f"{prefix}.tools", "CRM_LIST": f"{prefix}.crm",
            "IDEMMAIL_LEDGER_URL": os.environ.get("IDEMMAIL_LEDGER_URL", LOCAL_REDIS),
            "IDEMMAIL_LEDGER_OPTIONS": json.dumps({"prefix": prefix}),
            "IDEMMAIL_KEY_SECRET": "example-secret-do-not-use-in-production",
            "IDEMMAIL_PROVIDER_URL": provider_url, "IDEMMAIL_PROVIDER_API_KEY": api_key,
            "IDEMMAIL_INFLIGHT_BACKOFF": "0.2", "IDEMMAIL_INFLIGHT_BACKOFF_MAX": "1"}


def crm_note(deal_id: str, text: str) -> dict[str, Any]:
    """The agent examples' CRM: a note appended to a Redis list (the worker's ``CRM_LIST``); counts each call."""
    import redis

    crm = redis.Redis.from_url(os.environ.get("CELERY_BROKER_URL", LOCAL_REDIS))
    return {"notes": crm.rpush(f"{os.environ['CRM_LIST']}:{deal_id}", text)}


def crm_notes(prefix: str, deal_id: str) -> list[bytes]:
    """The notes an agent example's CRM holds for ``deal_id``, taken out (the list is deleted)."""
    import redis

    crm = redis.Redis.from_url(os.environ.get("CELERY_BROKER_URL", LOCAL_REDIS))
    notes: list[bytes] = crm.lrange(f"{prefix}.crm:{deal_id}", 0, -1)
    crm.delete(f"{prefix}.crm:{deal_id}")
    return notes
