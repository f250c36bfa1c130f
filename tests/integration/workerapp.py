"""The Celery app real test workers run: configured by environment variables.

Side effects land in Redis lists, a real store outside the worker, so tests
count deliveries from there and never from the tasks' return values.

``IDEMMAIL_TEST_NS`` names this test's namespace: its queue, its sink keys
and its ledger prefix/table all derive from it.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from typing import Any

import kombu
import redis
from celery import Celery
from celery.signals import task_postrun
from celery.worker.control import inspect_command

from idemmail_celery import AmbiguousSendError, IdempotentTask, TransientSendError, send_campaign, send_email  # noqa: F401

NS = os.environ.get("IDEMMAIL_TEST_NS", "default")
BROKER = os.environ.get("IDEMMAIL_TEST_BROKER", "redis://127.0.0.1:6379/0")
REDIS_URL = os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0")
LEDGER = os.environ.get("IDEMMAIL_TEST_LEDGER", REDIS_URL)

app = Celery("idemmail_tests", broker=BROKER, backend=REDIS_URL)
app.conf.update(
    task_default_queue=f"q.{NS}",
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    # Tests that kill a whole worker lower these so the Redis transport restores
    # unacked messages within seconds instead of ~100 s (kombu 5.7 defaults).
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("IDEMMAIL_TEST_VT", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # The restore's lock is one key on the whole broker (every test's workers share it). A worker SIGKILLed
        # while it holds the lock leaves it held for unacked_mutex_expire (kombu: 300 s), and no worker of
        # any test restores anything meanwhile; a restore here takes milliseconds.
        "unacked_mutex_expire": 5,
        # Threads and gevent pools ack from every thread or greenlet: the pool must hold that many (kombu: 10).
        "max_connections": int(os.environ.get("IDEMMAIL_TEST_MAX_CONNECTIONS", "10")),
    },
    idemmail_ledger_url=LEDGER,
    idemmail_ledger_options=(
        {"prefix": f"led.{NS}"} if LEDGER.startswith("redis") else {"table": f"led_{NS}"}
    ),
    # A rotation (tests/integration/test_sealed_headers.py, test_chain_ownership.py): comma-separated secrets,
    # newest first.
    idemmail_key_secret=(os.environ.get("IDEMMAIL_TEST_KEY_SECRETS") or "test-secret").split(","),
    idemmail_lease_seconds=float(os.environ.get("IDEMMAIL_TEST_LEASE", "30")),
    idemmail_retention_seconds=float(os.environ.get("IDEMMAIL_TEST_RETENTION", str(7 * 24 * 3600))),
    # send_email (registered on this app as a shared task when idemmail_celery is imported)
    idemmail_provider_url=os.environ.get("IDEMMAIL_TEST_PROVIDER") or None,
    idemmail_provider_api_key=os.environ.get("IDEMMAIL_TEST_PROVIDER_KEY") or None,
    idemmail_provider_timeout=float(os.environ.get("IDEMMAIL_TEST_PROVIDER_TIMEOUT", "5")),
    idemmail_default_from="Shop <shop@example.com>",
    # Metrics (tests/integration/test_monitoring.py): served from the worker's main process when set.
    idemmail_metrics_port=int(os.environ.get("IDEMMAIL_TEST_METRICS_PORT") or 0) or None,
    idemmail_metrics_addr="127.0.0.1",
    idemmail_campaign_pass_seconds=os.environ.get("IDEMMAIL_TEST_CAMPAIGN_PASS") or None,
    idemmail_refuse_to_start=bool(os.environ.get("IDEMMAIL_TEST_REFUSE_TO_START")),
)
if os.environ.get("IDEMMAIL_TEST_MAX_MESSAGE_BYTES"):  # a budget lowered by a deploy (test_refused_before_the_pool.py)
    app.conf.update(idemmail_max_message_bytes=os.environ["IDEMMAIL_TEST_MAX_MESSAGE_BYTES"])
if os.environ.get("IDEMMAIL_TEST_RETRY_DEADLINE"):  # a short retry deadline (tests/integration/test_retry_deadline.py)
    app.conf.update(idemmail_retry_deadline_seconds=os.environ["IDEMMAIL_TEST_RETRY_DEADLINE"])
# Re-drive (tests/integration/test_redrive.py): set only when asked, the library's defaults otherwise.
app.conf.update({name: os.environ[var] for name, var in (
    ("idemmail_restore_unacked", "IDEMMAIL_TEST_RESTORE_UNACKED"),
    ("idemmail_sweep_in_workers", "IDEMMAIL_TEST_SWEEP_IN_WORKERS"),
    ("idemmail_sweep_after_seconds", "IDEMMAIL_TEST_SWEEP_AFTER"),
) if os.environ.get(var)})

if not os.environ.get("IDEMMAIL_TEST_DEFAULT_BACKOFF"):  # short waits keep the tests short
    app.conf.update(idemmail_inflight_backoff=0.2, idemmail_inflight_backoff_max=1.0,
                    idemmail_retry_backoff=os.environ.get("IDEMMAIL_TEST_RETRY_BACKOFF") or 0.1,
                    idemmail_retry_backoff_max=os.environ.get("IDEMMAIL_TEST_RETRY_BACKOFF_MAX") or 0.5)

r = redis.Redis.from_url(REDIS_URL, decode_responses=True)


def k(name: str) -> str:
    return f"sink.{NS}.{name}"


def _control(name: str) -> str | None:
    value: str | None = r.get(k(f"ctl.{name}"))
    return value


def _deliver(key: str, to: str, body: str, *, dedupe: bool) -> str:
    """The side effect: one entry in the sink. ``dedupe`` plays a provider honouring the key."""
    r.rpush(k("attempts"), key)
    if dedupe and not r.set(k(f"seen.{key}"), "1", nx=True):
        return str(r.get(k(f"msgid.{key}")))
    n = r.rpush(k("deliveries"), f"{key}|{to}|{body}")
    msgid = f"msg-{n}"
    r.set(k(f"msgid.{key}"), msgid)
    return msgid


def _behave(key: str) -> None:
    """Per-test controls read from Redis: hold the claim, or die holding it."""
    r.rpush(k("pids"), os.getpid())
    hold = _control("hold")
    if hold:
        time.sleep(float(hold))
    if r.getdel(k("ctl.hold_until_released")):  # one run holds its claim until the test says so
        r.rpush(k("holding"), key)
        deadline = time.monotonic() + 60
        while not r.getdel(k("ctl.release")) and time.monotonic() < deadline:
            time.sleep(0.05)
    if r.getdel(k("ctl.die_before_send")):
        os.kill(os.getpid(), signal.SIGKILL)


def _next_failure(kind: str) -> bool:
    """Consume the next scripted failure if it is of this kind."""
    if r.lindex(k("ctl.fail_with"), 0) == kind:
        r.lpop(k("ctl.fail_with"))
        return True
    return False


def _after_send(key: str) -> None:
    if r.getdel(k("ctl.die_after_send")):
        os.kill(os.getpid(), signal.SIGKILL)  # the side effect happened; the ledger never hears
    if _next_failure("ambiguous"):
        raise AmbiguousSendError("read timeout after the request was written", reason="timeout")


@app.task(shared=False, base=IdempotentTask, bind=True, idempotency_key=("to", "order_id"))
def send(self: IdempotentTask, to: str, order_id: int, body: str = "hello") -> dict[str, Any]:
    """A send whose side effect cannot carry the key (think SMTP)."""
    key = self.request.idempotency_key
    _behave(key)
    if _next_failure("transient"):
        raise TransientSendError("connection refused before anything was written", reason="connect")
    msgid = _deliver(key, to, body, dedupe=False)
    _after_send(key)
    return {"message_id": msgid}


@app.task(
    shared=False, base=IdempotentTask, bind=True, idempotency_key=("to", "order_id"), idempotency_carries_key=True
)
def send_keyed(self: IdempotentTask, to: str, order_id: int, body: str = "hello") -> dict[str, Any]:
    """A send to a provider that de-duplicates on the key (think an HTTP API)."""
    key = self.request.idempotency_key
    _behave(key)
    msgid = _deliver(key, to, body, dedupe=True)
    _after_send(key)
    return {"message_id": msgid}


@app.task(shared=False, bind=True, acks_late=True)
def plain_send(self: Any, to: str, order_id: int, body: str = "hello") -> dict[str, Any]:
    """The same side effect without idempotency: the control group."""
    return {"message_id": _deliver(f"plain:{to}:{order_id}", to, body, dedupe=False)}


@task_postrun.connect
def _die_after_record(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    # After the ledger recorded sent, before the ack: the classic redelivery window.
    # The whole worker dies (its main process would otherwise still ack).
    if r.getdel(k("ctl.die_after_record")):
        os.killpg(os.getpgrp(), signal.SIGKILL)


@app.task(shared=False, base=IdempotentTask, bind=True, idempotency_key=("order_id",), idempotency_must_match=("to",))
def send_strict(self: IdempotentTask, to: str, order_id: int, body: str = "hello") -> dict[str, Any]:
    """A send whose key is the order alone, and whose recipient a duplicate must repeat."""
    return {"message_id": _deliver(self.request.idempotency_key, to, body, dedupe=False)}


class BoundedTask(IdempotentTask):
    """An idempotent task whose argument bound an operator changes: the sink's ``max_args`` control, read by the
    caller at ``delay()`` and by the worker's main process for each message (none when unset)."""

    abstract = True

    def max_argument_size(self) -> int | None:
        value = _control("max_args")
        return int(value) if value else None


@app.task(shared=False, base=BoundedTask, bind=True, idempotency_key=("to", "order_id"))
def send_bounded(self: IdempotentTask, to: str, order_id: int, body: str = "hello") -> dict[str, Any]:
    """A send whose first attempt may lower the bound (a deploy) and fail before sending: its retry meets it."""
    key = self.request.idempotency_key
    if _next_failure("lower_bound"):
        r.set(k("ctl.max_args"), _control("lower_bound_to") or "100")
        raise TransientSendError("connection refused before anything was written", reason="connect")
    return {"message_id": _deliver(key, to, body, dedupe=False)}


@inspect_command()
def message_copies(state: Any) -> dict[str, int]:
    """What the kombu messages alive in this process (the worker's main one) still hold: how many there are, and
    the characters of their bodies, of their transport's raw payloads (the body inside) and of their decoded
    bodies' strings (tests/integration/test_message_memory.py). Counted after a full collection: what is kept."""
    gc.collect()
    held = {"messages": 0, "body": 0, "raw": 0, "decoded": 0}
    for o in gc.get_objects():
        if isinstance(o, kombu.Message):
            held["messages"] += 1
            held["body"] += len(o.body or b"")
            held["raw"] += len(str((getattr(o, "_raw", None) or {}).get("body") or ""))
            held["decoded"] += _characters(o._decoded_cache)
    return held


def _characters(value: Any) -> int:
    """The characters of every string in ``value`` (lists and mappings walked)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, dict):
        return sum(_characters(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_characters(v) for v in value)
    return 0
