"""The Celery app chaos workers run (``celery -A chaos.workerapp worker``), configured by environment.

The orchestrator builds the same app in its own process with :func:`build_app` (same
settings, same key secret), so the keys it computes are the keys the workers claim.

Two tasks, both the library's own email path:

* ``idemmail_celery.send_email``, registered with :func:`idemmail_celery.mail.register`;
  with the HTTP fake it carries the key downstream (``Idempotency-Key``), with ``smtp://``
  it does not.
* ``chaos.send_email_keyless``: the same task with ``carries_key()`` forced to False, for
  the HTTP fake with ``dedupe=False`` (a provider that ignores keys): a crashed or
  ambiguous send must be parked for review, never resent.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery import _state as celery_state
from celery.signals import before_task_publish, task_postrun, task_prerun

from idemmail_celery.bulk import CAMPAIGN_TASK, send_campaign  # noqa: F401  (the campaign scenario)
from idemmail_celery.chain import HOP_HEADER
from idemmail_celery.mail import TASK_NAME, SendEmailTask, register

KEYLESS_TASK = "chaos.send_email_keyless"
KEY_SECRET = "chaos-secret"

ENV = {
    "ns": "CHAOS_NS",
    "broker": "CHAOS_BROKER",
    "ledger": "CHAOS_LEDGER",
    "provider": "CHAOS_PROVIDER",
    "provider_key": "CHAOS_PROVIDER_KEY",
    "provider_timeout": "CHAOS_PROVIDER_TIMEOUT",
    "lease": "CHAOS_LEASE",
    "visibility_timeout": "CHAOS_VT",
    "trace": "CHAOS_TRACE",
    "defaults": "CHAOS_DEFAULTS",
    "key_secrets": "CHAOS_KEY_SECRETS",
    "restore_defaults": "CHAOS_RESTORE_DEFAULTS",
}
"""Config name -> environment variable, for :func:`config_from_env` and :func:`worker_env`."""


class KeylessSendEmail(SendEmailTask):
    """``send_email`` for a provider that ignores the key: ambiguous means review."""

    def carries_key(self) -> bool:
        return False


def _send_keyless(self: KeylessSendEmail, **kwargs: Any) -> dict[str, Any]:
    """The ``send_email`` body, keyword arguments only, on a keyless downstream."""
    message = self.message_from(kwargs)
    result = self.provider.send(message, key=self.request.idempotency_key)
    return result.to_dict()


def config_from_env() -> dict[str, str]:
    return {name: os.environ.get(var, "") for name, var in ENV.items()}


def worker_env(config: dict[str, str]) -> dict[str, str]:
    """Environment variables that give a worker subprocess ``config``."""
    return {ENV[name]: str(value) for name, value in config.items() if name in ENV}


def broker_options(config: dict[str, str]) -> dict[str, Any]:
    """Redis transport options: its own key prefix, and restores within seconds (kombu 5.7 names), or at
    the transport's own pace (``restore_defaults``: 10 s x 10 in the event loop, 10 s in a green pool's timer)."""
    if not config["broker"].startswith("redis"):
        return {}
    quick = {} if config.get("restore_defaults") else {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}
    return {
        "global_keyprefix": f"{config['ns']}.",
        "visibility_timeout": float(config["visibility_timeout"] or 3600),
        **quick,
        "max_connections": 200,  # a gevent worker acks from each of its greenlets (kombu's default pool: 10)
    }


def ledger_options(config: dict[str, str]) -> dict[str, Any]:
    """The ledger's own namespace: a Redis key prefix or an SQL table."""
    ns = config["ns"]
    return {"prefix": f"{ns}.led"} if config["ledger"].startswith("redis") else {"table": f"{ns}_ledger"}


def build_app(config: dict[str, str]) -> Celery:
    """A Celery app for one chaos run, with ``send_email`` and the keyless variant registered."""
    ns = config["ns"] or "chaos"
    app = Celery(f"chaos-{ns}", broker=config["broker"] or "redis://127.0.0.1:6379/0", set_as_current=False)
    tuned: dict[str, Any] = {} if config.get("defaults") else {
        # A retry after a fault must not run out: the run is about exactly-once, not budgets.
        "task_annotations": {TASK_NAME: {"max_retries": 100}, KEYLESS_TASK: {"max_retries": 100}},
        "idemmail_lease_seconds": float(config["lease"] or 3),
        "idemmail_inflight_backoff": 0.2,
        "idemmail_inflight_backoff_max": 1.0,
        "idemmail_retry_backoff": 0.1,
        "idemmail_retry_backoff_max": 0.5,
    }
    app.conf.update(
        task_default_queue=f"{ns}.q",
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # the verdict never reads return values
        worker_prefetch_multiplier=1,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options=broker_options(config),
        idemmail_ledger_url=config["ledger"],
        idemmail_ledger_options=ledger_options(config),
        # A rotation mid-run: a JSON array, newest first (the old secret last, so older records are found).
        idemmail_key_secret=json.loads(config["key_secrets"]) if config.get("key_secrets") else KEY_SECRET,
        idemmail_provider_url=config["provider"] or None,
        idemmail_provider_api_key=config["provider_key"] or None,
        idemmail_provider_timeout=float(config["provider_timeout"] or 1.0),
        idemmail_default_from="Shop <shop@example.com>",
        **tuned,
    )
    register(app)
    app.task(base=KeylessSendEmail, bind=True, name=KEYLESS_TASK)(_send_keyless)
    return app


# -- the execution trace: one line per task execution that started (receipts), one per execution that
# finished (trace) and one per message a worker published (publishes), so the orchestrator can tell a
# message handed out again from a message published anew, and a chain that hops from copies that multiply. --

_config = config_from_env()
_trace = redis.Redis.from_url(_config["trace"]) if _config["trace"] else None
#: (task id, id of the request) -> (start, redelivered): one task id may run twice at once in one process.
_started: dict[tuple[str, int], tuple[float, bool]] = {}


def trace_key(ns: str) -> str:
    return f"{ns}.trace"


def receipts_key(ns: str) -> str:
    """One line per execution that started: task id, pid, start, intent key, message (hop), redelivered."""
    return f"{ns}.receipts"


def publishes_key(ns: str) -> str:
    """One line per message a worker published: task id, message (hop), the task id and message of the
    execution that published it (None outside one), when, and when it is due (its countdown or ETA)."""
    return f"{ns}.publishes"


def hop_of(task_id: str, headers: dict[str, Any] | None, request: Any = None) -> str:
    """The message a delivery or a publish is: the library's hop id (new on every publish, the same on a
    redelivery), or the task id for a message the library never republished."""
    hop = (headers or {}).get(HOP_HEADER) or (getattr(request, HOP_HEADER, None) if request is not None else None)
    return str(hop or task_id)


@task_prerun.connect
def _trace_start(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    if _trace is not None and task_id:
        now = time.time()
        request = task.request
        redelivered = bool((request.delivery_info or {}).get("redelivered"))
        _started[(task_id, id(request))] = (now, redelivered)
        key = (request.headers or {}).get("idempotency_key") or getattr(request, "idempotency_key", None)
        hop = hop_of(task_id, request.headers, request)
        _trace.rpush(receipts_key(_config["ns"]), json.dumps([task_id, os.getpid(), now, key, hop, redelivered]))


@task_postrun.connect
def _trace_end(task_id: str | None = None, task: Any = None, state: str | None = None, **_: Any) -> None:
    if _trace is not None and task_id and (task_id, id(task.request)) in _started:
        start, redelivered = _started.pop((task_id, id(task.request)))
        line = [task_id, os.getpid(), start, time.time(), redelivered, state]
        _trace.rpush(trace_key(_config["ns"]), json.dumps(line))


@before_task_publish.connect
def _trace_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if _trace is None or not headers or not headers.get("id"):
        return
    now = time.time()
    task_id = str(headers["id"])
    due = now
    if headers.get("eta"):
        with_tz = datetime.datetime.fromisoformat(str(headers["eta"]))
        due = with_tz.timestamp() if with_tz.tzinfo else with_tz.replace(tzinfo=datetime.timezone.utc).timestamp()
    running = celery_state.get_current_task()
    parent = running.request if running is not None else None
    parent_id = getattr(parent, "id", None)
    parent_hop = hop_of(parent_id, parent.headers, parent) if parent is not None and parent_id else None
    _trace.rpush(publishes_key(_config["ns"]),
                 json.dumps([task_id, hop_of(task_id, headers), parent_id, parent_hop, now, due]))


app = build_app(_config)
