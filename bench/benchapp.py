"""The Celery app bench workers run (``celery -A bench.benchapp worker``), configured by environment.

Every task has the same no-op body (the "no-op provider send"): it marks itself done in one
pipelined Redis round trip (a counter, the first and last completion times, and the SQL
statements the ledger ran since the last mark), so every variant pays the same for being
measured. The variants differ only in what wraps the body:

==============  ================================================================
``bench.plain``  a plain Celery task (``acks_late=True``, like the others): the ceiling
``bench.naive`` a hand-rolled run-time claim: Redis ``SET NX`` before the body, ``SET`` after
``bench.naive_pg`` the same on PostgreSQL: ``INSERT ... ON CONFLICT DO NOTHING`` before, ``UPDATE``
                 after, two autocommit statements on one psycopg connection (the floor for a SQL ledger)
``bench.idem``   :class:`IdempotentTask`; the ledger (Redis, PostgreSQL or SQLite) comes
                 from ``BENCH_LEDGER``/``BENCH_LEDGER_OPTIONS``
``bench.once``   celery-once's ``QueueOnce`` on the same Redis (the peer)
==============  ================================================================

For the I/O-bound and bulk runs (:mod:`bench.scale`) the body is a real HTTP send to the fake
provider at ``BENCH_PROVIDER_URL``: ``idemmail_celery.send_email`` (and ``send_campaign``) against
``bench.plain_http``, a plain Celery task making the same call through the same provider client.
Those runs stamp completions in ``task_postrun`` (``BENCH_WINDOW``), for every variant alike, and
count the ledger's round trips at the client (``BENCH_COUNT_LEDGER``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_ready
from sqlalchemy import event
from sqlalchemy.engine import Engine

from chaos.procs import cpu_seconds, tree_cpu_seconds
from idemmail_celery import IdempotentTask
from idemmail_celery.bulk import CAMPAIGN_TASK
from idemmail_celery.mail import TASK_NAME as SEND_EMAIL
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY
from idemmail_celery.testing.statements import count_statements

try:  # the peer is optional: `make bench` installs it from bench/requirements.txt
    from celery_once import QueueOnce
except ImportError:  # pragma: no cover - reported by bench.run
    QueueOnce = None

NS = os.environ.get("BENCH_NS", "bench")
RUN = os.environ.get("BENCH_RUN", "r")
REDIS_URL = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0")
KEY_SECRET = "bench-secret"

_r = redis.Redis.from_url(REDIS_URL)
#: Where ``bench.naive`` claims: the bench's Redis, or the server of the variant measured (a Valkey server).
_store = redis.Redis.from_url(os.environ["BENCH_STORE"]) if os.environ.get("BENCH_STORE") else _r
_sql_statements = 0
_ledger_round_trips = 0
#: The I/O-bound and bulk runs (``BENCH_WINDOW=lo,hi``): completions counted in ``task_postrun``,
#: time and CPU stamped at the lo-th and hi-th.
_window = [int(x) for x in os.environ.get("BENCH_WINDOW", "").split(",") if x]


def _count_sql(*_: Any) -> None:
    global _sql_statements
    _sql_statements += 1
    if _sql_statements >= 500 and _window:  # the I/O and bulk runs: the shared total, a batch at a time
        _flush_round_trips()


def _count_statements_of(dbapi_conn: Any, _record: Any) -> None:
    # At the driver: a SQLAlchemy statement listener would switch the SQL ledger's path (see count_statements).
    count_statements(dbapi_conn, _count_sql)


event.listen(Engine, "connect", _count_statements_of)  # every engine's pool: a pool event, not a statement one


def keys(run: str) -> dict[str, str]:
    """The Redis keys one measurement writes (shared with :mod:`bench.run`)."""
    return {"count": f"{NS}.{run}.count", "times": f"{NS}.{run}.times", "finished": f"{NS}.{run}.finished"}


def _done(kind: str) -> dict[str, Any]:
    """The no-op send: count it and stamp the time, in one round trip."""
    global _sql_statements
    k = keys(RUN)
    now = time.time()
    pipe = _r.pipeline(transaction=False)
    pipe.incr(f"{k['count']}.{kind}")
    pipe.hsetnx(k["times"], "first", now)
    pipe.hset(k["times"], "last", now)
    if _sql_statements:
        pipe.hincrby(k["times"], "sql", _sql_statements)
        _sql_statements = 0
    pipe.execute()
    return {"id": f"noop-{now}"}


_transport_options: dict[str, Any] = {"global_keyprefix": f"{NS}."}
if os.environ.get("BENCH_BROKER_MAX_CONNECTIONS"):
    # kombu's Redis transport keeps at most 10 connections; a gevent pool of 200 acks from many
    # greenlets at once and fails with MaxConnectionsError without more (plain Celery alike).
    _transport_options["max_connections"] = int(os.environ["BENCH_BROKER_MAX_CONNECTIONS"])
if os.environ.get("BENCH_VISIBILITY_TIMEOUT"):  # the bulk run's whole-worker kill: redelivered this soon
    _transport_options.update(visibility_timeout=float(os.environ["BENCH_VISIBILITY_TIMEOUT"]),
                              unacked_restore_interval=1, unacked_restore_throttle=1)

app = Celery("bench", broker=os.environ.get("BENCH_BROKER", REDIS_URL), set_as_current=False,
             backend=os.environ.get("BENCH_RESULT_BACKEND") or None)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_ignore_result=True,
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
    broker_transport_options=_transport_options,
    idemmail_ledger_url=os.environ.get("BENCH_LEDGER", "redis://127.0.0.1:6379/0"),
    idemmail_ledger_options=json.loads(os.environ.get("BENCH_LEDGER_OPTIONS") or "{}"),
    idemmail_key_secret=KEY_SECRET,
    idemmail_provider_url=os.environ.get("BENCH_PROVIDER_URL") or None,
    idemmail_provider_api_key=DEFAULT_API_KEY,
    idemmail_provider_timeout=30.0,
    idemmail_default_from="Bench <bench@example.com>",
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": REDIS_URL, "default_timeout": 3600}},
)


@app.task(name="bench.plain", acks_late=True)
def plain(to: str, n: int) -> dict[str, Any]:
    """No idempotency at all."""
    return _done("plain")


@app.task(name="bench.idem", base=IdempotentTask, bind=True, idempotency_key=("to", "n"))
def idem(self: IdempotentTask, to: str, n: int) -> dict[str, Any]:
    """The same body under the ledger."""
    return _done("idem")


@app.task(name="bench.naive", acks_late=True)
def naive(to: str, n: int) -> dict[str, Any]:
    """The hand-rolled run-time claim the issue measures against: ``SET NX`` before, ``SET`` after.

    Two plain Redis round trips and nothing else: no fencing, no lease renewal, no stored
    outcome to replay, a crash leaves the key claimed until it expires. The floor for any
    run-time claim that takes two round trips.
    """
    key = f"{NS}.naive.{hashlib.sha256(f'{to}|{n}'.encode()).hexdigest()}"
    if not _store.set(key, "claimed", nx=True, ex=300):
        return {"status": "duplicate"}
    out = _done("naive")
    _store.set(key, "sent", ex=7 * 86400)
    return out


#: The floor's table (``bench.naive_pg``): a key and a state, only its primary key.
FLOOR_TABLE_DDL = 'CREATE TABLE "{table}" (k varchar(64) PRIMARY KEY, state varchar(16))'


_pg: tuple[int, Any] | None = None  # (pid, psycopg connection): one per process, never across a fork


def _pg_conn() -> Any:
    global _pg
    if _pg is None or _pg[0] != os.getpid():
        import psycopg

        dsn = os.environ.get("BENCH_LEDGER", "").replace("postgresql+psycopg://", "postgresql://", 1)
        conn = psycopg.connect(dsn, autocommit=True)
        count_statements(conn, _count_sql)
        _pg = (os.getpid(), conn)
    return _pg[1]


@app.task(name="bench.naive_pg", acks_late=True)
def naive_pg(to: str, n: int) -> dict[str, Any]:
    """The floor for a run-time claim in PostgreSQL: two single-row autocommit statements, nothing else.

    A two-column table (key, state) with only its primary key; no lease, token, payload or
    stored outcome. What any SQL ledger that claims before the body and records after must pay
    at least: two durable commits (the claim must be on disk before the send).
    """
    table = app.conf.idemmail_ledger_options["table"]
    key = hashlib.sha256(f"{to}|{n}".encode()).hexdigest()
    conn = _pg_conn()
    if conn.execute(f'INSERT INTO "{table}" (k, state) VALUES (%s, %s) ON CONFLICT DO NOTHING',
                    (key, "claimed")).rowcount == 0:
        return {"status": "duplicate"}
    out = _done("naive_pg")
    conn.execute(f'UPDATE "{table}" SET state = %s WHERE k = %s', ("sent", key))
    return out


if QueueOnce is not None:

    @app.task(name="bench.once", base=QueueOnce, acks_late=True, once={"keys": ["to", "n"], "graceful": True})
    def once(to: str, n: int) -> dict[str, Any]:
        """The same body under celery-once's enqueue-time lock."""
        return _done("once")


# httpx logs every request at INFO; a sender at scale turns that off, and so does the bench (all variants).
logging.getLogger("httpx").setLevel(logging.WARNING)

if os.environ.get("BENCH_LEASE"):
    app.conf.idemmail_lease_seconds = float(os.environ["BENCH_LEASE"])


@app.task(name="bench.plain_http", acks_late=True)
def plain_http(to: str, subject: str, text: str, n: int) -> dict[str, Any]:
    """Plain Celery making the HTTP call ``send_email`` makes: the message built and checked the same
    way, sent through the same provider client, under a key of its own; no ledger."""
    sender = app.tasks[SEND_EMAIL]
    message = sender.message_from({"to": to, "subject": subject, "text": text})
    return dict(sender.provider.send(message, key=f"plain-{RUN}-{n}").to_dict())


_naive_ledger: redis.Redis | None = None


@app.task(name="bench.naive_http", acks_late=True)
def naive_http(to: str, subject: str, text: str, n: int) -> dict[str, Any]:
    """The I/O runs' floor: ``bench.plain_http``'s call between the hand-rolled claim (``SET NX`` before,
    ``SET`` after) on the ledger's Redis, as ``bench.naive`` does for the no-op runs."""
    global _naive_ledger
    if _naive_ledger is None:
        _naive_ledger = redis.Redis.from_url(os.environ["BENCH_LEDGER"])
    key = f"{NS}.naive_http.{hashlib.sha256(f'{to}|{n}'.encode()).hexdigest()}"
    if not _naive_ledger.set(key, "claimed", nx=True, ex=300):
        return {"status": "duplicate"}
    out = plain_http(to, subject, text, n)
    _naive_ledger.set(key, "sent", ex=7 * 86400)
    return out


# -- the I/O-bound and bulk runs: completions stamped after the task, ledger round trips counted --



def _flush_round_trips(at_least: int = 1) -> None:
    """Add this process's count of ledger round trips to the shared total (it dies with a SIGKILL)."""
    global _ledger_round_trips, _sql_statements
    n, _ledger_round_trips = _ledger_round_trips + _sql_statements, 0
    _sql_statements = 0
    if n >= at_least:
        _r.incrby(f"{keys(RUN)['count']}.ledger_rt", n)
    else:
        _ledger_round_trips = n


if os.environ.get("BENCH_COUNT_LEDGER"):
    # Every request written to the ledger's own Redis (a server of the bench's own, on this port)
    # is one round trip: a single command, or a whole pipeline (claim_many). SQL ledgers are
    # counted per statement at the driver (above).
    from redis.connection import AbstractConnection

    _ledger_port = int(os.environ["BENCH_COUNT_LEDGER"])
    _send_packed = AbstractConnection.send_packed_command

    def _counted(self: Any, command: Any, check_health: bool = True) -> None:
        global _ledger_round_trips
        if getattr(self, "port", None) == _ledger_port:
            _ledger_round_trips += 1
            if _ledger_round_trips >= 100:  # a SIGKILLed process loses fewer than this
                _flush_round_trips()
        _send_packed(self, command, check_health)

    AbstractConnection.send_packed_command = _counted  # type: ignore[method-assign]


#: Raise the highest count of campaign runs under way at once to the count now (one script: no lost update).
_RAISE_MAX = "local n = redis.call('INCRBY', KEYS[1], ARGV[1]) if n > tonumber(redis.call('GET', KEYS[2]) or 0) " \
             "then redis.call('SET', KEYS[2], n) end return n"

if _window:

    @task_prerun.connect
    def _campaign_started(task: Any = None, **_: Any) -> None:
        if getattr(task, "name", "") == CAMPAIGN_TASK:  # a copy handed out while another runs would show
            k = keys(RUN)
            _r.eval(_RAISE_MAX, 2, f"{k['count']}.campaign_running", f"{k['count']}.campaign_max", 1)

    @task_postrun.connect
    def _stamp(state: str | None = None, task: Any = None, **_: Any) -> None:
        # After the task, the ledger's completion included; every variant pays the same.
        k = keys(RUN)
        if getattr(task, "name", "") == CAMPAIGN_TASK:
            _r.decr(f"{k['count']}.campaign_running")
        # Rarely, so that the count costs the sends nothing to speak of; all of it after a campaign run.
        _flush_round_trips(at_least=1 if getattr(task, "name", "") == CAMPAIGN_TASK else 500)
        if state != "SUCCESS":
            _r.incr(f"{k['count']}.not_success")
            return
        n = _r.incr(f"{k['count']}.io")
        if n in _window:
            _r.hset(k["times"], mapping={f"t{n}": time.time(), f"cpu{n}": time.process_time()})


@worker_ready.connect
def _cpu_at_ready(**_: Any) -> None:
    # Start of the drain: the worker's own CPU so far (imports, pool start-up) is left out.
    _r.hset(keys(RUN)["times"], mapping={"cpu_ready": tree_cpu_seconds(os.getpid()),
                                         "cpu_ready_main": cpu_seconds(os.getpid())})


if os.environ.get("BENCH_POSTRUN"):

    @task_postrun.connect
    def _finished(**_: Any) -> None:
        # Every execution, a replay included (the once-per-intent experiment only).
        _r.incr(keys(RUN)["finished"])
