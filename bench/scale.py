"""The scale parts of ``make bench``: I/O-bound sends, ledger capacity, a 100,000-recipient campaign.

Each part is chosen with ``--parts`` (``python -m bench.run --parts io,capacity,bulk``) and writes
its own section of ``docs/benchmarks.md``:

* **io**: ``send_email`` (an :class:`~idemmail_celery.IdempotentTask`) against a plain Celery task
  making the same HTTP call through the same provider client, to the fake provider holding every
  send ``latency`` seconds (50 and 200 ms), in ``-P threads -c 50`` and ``-P gevent -c 200``
  workers, with the Redis and the PostgreSQL ledger. Sends per second between the 10th and the
  90th percentile of completions, stamped after each task (``task_postrun``); the ratio to plain
  in the same repetition, pool and latency.
* **capacity**: claims + completions per second on one Redis and one PostgreSQL with 1, 8 and 64
  callers (forked processes, up to 8, each with threads), and the Redis CPU each send costs
  (``INFO cpu`` and ``INFO commandstats`` of a Redis server holding nothing but the ledger).
* **bulk**: one ``send_campaign`` of 100,000 recipients through real workers (two, ``-P prefork
  -c 2``) and the fake provider; the worker running it is SIGKILLed (whole process group) when
  half the recipients are settled, and restarted. Wall time to every recipient settled, ledger
  round trips counted at the client, and the provider's own count of deliveries per key.

A part's figures come from one run; medians and min-max over ``--repeat`` repetitions.
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from chaos.procs import WorkerProcess, wait_until
from idemmail_celery.bulk import CAMPAIGN_TASK
from idemmail_celery.ledger import ClaimRequest, Ledger, State, from_url
from idemmail_celery.mail import TASK_NAME as SEND_EMAIL
from idemmail_celery.testing.fake_provider import FakeProvider

if TYPE_CHECKING:
    from bench.run import Harness

IO_VARIANTS = ("plain", "naive-http", "idem-redis", "idem-pg")
IO_LABELS = {
    "plain": "plain Celery task, same HTTP call",
    "naive-http": "the same call under a hand-rolled SET NX claim (the floor)",
    "idem-redis": "send_email, Redis ledger",
    "idem-pg": "send_email, PostgreSQL ledger",
}
SUBJECT = "Your receipt for order 4821"
TEXT = "Hello,\n\nthank you for your order. " + "Your receipt is below.\n" * 20
#: The PostgreSQL ledger's pool in the I/O runs: a claim holds a connection for one statement,
#: never across the provider call, so a few connections serve a pool of 200.
PG_POOL = {"pool_size": 10, "max_overflow": 20}


def fmt(values: list[float]) -> str:
    """Median (min-max), or ``-``."""
    if not values:
        return "-"
    m = statistics.median(values)
    f = "{:,.0f}" if m >= 100 else "{:.2f}"
    return f.format(m) if len(values) == 1 else f"{f.format(m)} ({f.format(min(values))}-{f.format(max(values))})"


def parse_pools(text: str) -> list[tuple[str, int]]:
    """``threads:50,gevent:200`` -> [("threads", 50), ("gevent", 200)]."""
    out = []
    for item in text.split(","):
        pool, _, conc = item.partition(":")
        if pool not in ("threads", "gevent", "prefork") or not conc.isdigit():
            raise ValueError(f"pool {item!r}: expected threads:N, gevent:N or prefork:N")
        out.append((pool, int(conc)))
    return out


# -- I/O-bound sends --


@dataclass
class IoRun:
    """One variant, pool, latency and repetition."""

    variant: str
    pool: str
    concurrency: int
    latency: float
    rep: int
    sends: int
    rate: float = 0.0
    cpu_ms: float = 0.0
    cores: float = 0.0
    provider_cores: float = 0.0
    deliveries: int = 0
    not_success: int = 0


def io_drain(h: Harness, provider: FakeProvider, ledger_redis: str, variant: str, pool: str, concurrency: int,
             latency: float, rep: int, sends: int) -> IoRun:
    """Enqueue ``sends`` messages, then start a worker and time the middle 80% of their completions."""
    mid = f"io{rep}{pool[0]}{concurrency}l{round(latency * 1000)}{variant.replace('-', '')}"
    if variant == "idem-pg":
        url, options = h.ledger_config("idem-pg", mid)
        options = {**options, **PG_POOL}
    else:
        url, options = ledger_redis, {"prefix": f"{h.ns}.{mid}.led"}
    if variant not in ("plain", "naive-http"):  # the table (or the scripts and markers) outside the measurement
        led = from_url(url, **options)
        led.ping()
        led.close()
    provider.latency = latency
    provider.dedupe = False  # every accepted request counts as a delivery: a second send would show
    provider.reset()
    lo, hi = max(1, sends // 10), max(2, sends * 9 // 10)
    h.queue[0] = f"{h.ns}.{mid}"
    if variant in ("plain", "naive-http"):
        task = h.app.tasks["bench.plain_http" if variant == "plain" else "bench.naive_http"]
        for i in range(sends):
            task.delay(f"u{i}.{mid}@example.com", SUBJECT, TEXT, i)
    else:
        task = h.app.tasks[SEND_EMAIL]
        for i in range(sends):
            task.delay(to=f"u{i}.{mid}@example.com", subject=SUBJECT, text=TEXT, event_id=f"{mid}-{i}")
    keys = h.benchapp.keys(mid)
    env = h.worker_env(mid, url, options, BENCH_WINDOW=f"{lo},{hi}", BENCH_PROVIDER_URL=provider.url,
                       BENCH_BROKER_MAX_CONNECTIONS=str(concurrency + 50))
    w = WorkerProcess(f"{h.ns}-{mid}", "bench.benchapp", ["-P", pool, "-c", str(concurrency), "-Q", h.queue[0]],
                      env, h.tmp)
    done_key, other_key = f"{keys['count']}.io", f"{keys['count']}.not_success"
    try:
        w.start(wait_ready=0)
        # A plain task that fails is done with; send_email's "not SUCCESS" are retries, still to come.
        failed_for_good = 1 if variant in ("plain", "naive-http") else 0
        marks: dict[int, tuple[float, float]] = {}  # this process's CPU (the fake provider's threads) at lo and hi

        def finished() -> bool:
            done = int(h.r.get(done_key) or 0)
            for n in (lo, hi):
                if done >= n and n not in marks:
                    marks[n] = (time.monotonic(), time.process_time())
            return done + failed_for_good * int(h.r.get(other_key) or 0) >= sends

        ok = wait_until(finished, timeout=h.args.timeout, interval=0.02)
        if not ok or int(h.r.get(done_key) or 0) < hi:
            raise RuntimeError(f"io {variant}/{pool}: {h.r.get(done_key)!s} of {sends} sends succeeded and "
                               f"{h.r.get(other_key)!s} did not within {h.args.timeout}s; see {w.log_path}")
    finally:
        w.stop()
    times = {k: float(v) for k, v in h.r.hgetall(keys["times"]).items() if k.startswith(("t", "cpu"))}
    run = IoRun(variant, pool, concurrency, latency, rep, sends)
    wall = times[f"t{hi}"] - times[f"t{lo}"]
    cpu = times[f"cpu{hi}"] - times[f"cpu{lo}"]
    run.rate = (hi - lo) / wall
    run.cpu_ms = cpu * 1000 / (hi - lo)
    run.cores = cpu / wall
    if lo in marks and hi in marks and marks[hi][0] > marks[lo][0]:
        run.provider_cores = (marks[hi][1] - marks[lo][1]) / (marks[hi][0] - marks[lo][0])
    run.deliveries = provider.delivery_count()
    run.not_success = int(h.r.get(f"{keys['count']}.not_success") or 0)
    return run


def io_table(runs: list[IoRun], pool: str, concurrency: int, latency: float) -> str:
    cell = [r for r in runs if (r.pool, r.concurrency, r.latency) == (pool, concurrency, latency)]
    reps = sorted({r.rep for r in cell})
    lines = ["| variant | sends/s | ratio to plain | worker CPU ms/send | worker CPU, cores | fake provider CPU, cores "
             "| deliveries/sends |", "|---|---:|---:|---:|---:|---:|---|"]
    for v in IO_VARIANTS:
        mine = [r for r in cell if r.variant == v]
        if not mine:
            continue
        ratios = []
        for rep in reps:
            a = [r.rate for r in mine if r.rep == rep]
            b = [r.rate for r in cell if r.rep == rep and r.variant == "plain"]
            if a and b:
                ratios.append(a[0] / b[0])
        checked = "all equal" if all(r.deliveries == r.sends and not r.not_success for r in mine) else "; ".join(
            f"{r.deliveries}/{r.sends} ({r.not_success} not SUCCESS)" for r in mine)
        lines.append(f"| {IO_LABELS[v]} | {fmt([r.rate for r in mine])} | {fmt(ratios)} "
                     f"| {fmt([r.cpu_ms for r in mine])} | {fmt([r.cores for r in mine])} "
                     f"| {fmt([r.provider_cores for r in mine])} | {checked} |")
    return "\n".join(lines)


def io_section(runs: list[IoRun], sends: int, repeat: int, command: str, facts: str, seconds: float) -> str:
    cells = sorted({(r.pool, r.concurrency, r.latency) for r in runs}, key=lambda c: (c[0] != "threads", c[2]))
    tables = "\n\n".join(
        f"### `-P {pool} -c {conc}`, provider latency {round(lat * 1000)} ms "
        f"(ceiling {conc / lat:,.0f} sends/s)\n\n{io_table(runs, pool, conc, lat)}"
        for pool, conc, lat in cells
    )
    return f"""## Realistic sends: I/O-bound, `-P threads` and `-P gevent` (`make bench`)

```
{command}
```

Run on {facts}; wall time {seconds / 60:.1f} min.

{repeat} repetition(s) of {sends:,} sends per variant, pool and latency, in one run; **median (min-max)**,
the ratio taken against plain in the *same* repetition.

Every send is a real HTTP POST to the fake provider (a threaded HTTP server in the benchmark
process) that holds it for the given latency, as a provider's API does. `send_email` is the
library's task (`IdempotentTask`: key, claim, send with `Idempotency-Key`, record); the plain task
builds and checks the same message and sends it through the same provider client (httpx), with no
ledger. Rate: completions between the 10th and the 90th percentile, stamped in `task_postrun` (after
the ledger's record) over their wall time, so worker start-up and the tail are left out. Worker
CPU: the worker process's CPU time (one process: threads and greenlets share it) over the same
window, per send and in cores (1.0 = one core busy: the pool is CPU-bound, not waiting on I/O).
The ceiling is concurrency / latency. The Redis broker's `max_connections` is raised to
concurrency + 50 for every variant (kombu's default of 10 fails acks from a gevent pool of 200 with
`MaxConnectionsError`, plain Celery alike); the PostgreSQL ledger pool is `pool_size=10,
max_overflow=20` (a claim holds a connection for one statement, never across the provider call).
Deliveries are the provider's own count (a provider that does not de-duplicate, so a second send
of anything would show).

{tables}
"""


# -- ledger capacity --


@dataclass
class CapacityRun:
    """One ledger, number of callers and repetition."""

    ledger: str
    callers: int
    processes: int
    rep: int
    ops: int
    rate: float = 0.0
    redis_cpu_us: float | None = None
    evalsha_usec: float | None = None


def _request(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="bench.capacity", payload='{"args":[],"kwargs":{"to":"a@example.com"}}',
                        fingerprint="f" * 64)


def _caller_process(url: str, options: dict[str, Any], tag: str, threads: int, per_thread: int,
                    start: Any, out: Any) -> None:
    led = from_url(url, **options)
    try:
        for i in range(3):  # connect, load the scripts or create the table, outside the timing
            c = led.claim(_request(f"{tag}.warm{i}"))
            led.complete(c.record.key, c.token, {"message_id": "w"})

        def work(t: int) -> None:
            for i in range(per_thread):
                key = f"{tag}.{t}.{i}"
                claim = led.claim(_request(key))
                led.complete(key, claim.token, {"message_id": f"m{i}"})

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        start.wait()
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        out.put(None)
    except BaseException as exc:  # reported by the parent
        out.put(f"{type(exc).__name__}: {exc}")
    finally:
        led.close()


def _redis_cpu(client: redis.Redis) -> tuple[float, int, float]:
    """(used CPU seconds, EVALSHA calls, EVALSHA usec in all) of a Redis server."""
    cpu = client.info("cpu")
    stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), int(stats["calls"]), float(stats["usec"])


def capacity_run(ledger: str, url: str, options: dict[str, Any], callers: int, ops: int, rep: int,
                 redis_client: redis.Redis | None) -> CapacityRun:
    """``callers`` callers claim and complete ``ops`` new keys in all; claims+completions per second."""
    processes = min(callers, 8)
    threads = callers // processes
    per_thread = max(1, ops // callers)
    if ledger == "postgresql":
        options = {**options, "pool_size": threads, "max_overflow": 0}
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    tag = f"c{rep}.{callers}.{uuid.uuid4().hex[:6]}"
    procs = [ctx.Process(target=_caller_process, args=(url, options, f"{tag}.{p}", threads, per_thread, start, out))
             for p in range(processes)]
    for p in procs:
        p.start()
    time.sleep(1.0 + 0.05 * processes)  # every caller connected and warm
    before = _redis_cpu(redis_client) if redis_client is not None else None
    t0 = time.perf_counter()
    start.set()
    errors = [e for e in (out.get(timeout=600) for _ in procs) if e]
    elapsed = time.perf_counter() - t0
    after = _redis_cpu(redis_client) if redis_client is not None else None
    for p in procs:
        p.join(30)
    if errors:
        raise RuntimeError(f"capacity {ledger} x{callers}: {errors[0]}")
    done = per_thread * callers
    run = CapacityRun(ledger, callers, processes, rep, done, rate=done / elapsed)
    if before is not None and after is not None:
        run.redis_cpu_us = (after[0] - before[0]) * 1e6 / done
        calls = after[1] - before[1]
        run.evalsha_usec = (after[2] - before[2]) / calls if calls else None
    return run


def capacity_section(runs: list[CapacityRun], ops: int, repeat: int, buckets: int, command: str, facts: str,
                     seconds: float) -> str:
    lines = ["| ledger | callers (processes x threads) | claims+completions/s | Redis CPU µs per send "
             "| EVALSHA µs per call (server) |", "|---|---|---:|---:|---:|"]
    for ledger in ("redis", "postgresql"):
        for callers in sorted({r.callers for r in runs if r.ledger == ledger}):
            rs = [r for r in runs if (r.ledger, r.callers) == (ledger, callers)]
            cpu = [r.redis_cpu_us for r in rs if r.redis_cpu_us is not None]
            usec = [r.evalsha_usec for r in rs if r.evalsha_usec is not None]
            lines.append(f"| {ledger} | {callers} ({rs[0].processes} x {callers // rs[0].processes}) "
                         f"| {fmt([r.rate for r in rs])} | {fmt(cpu)} | {fmt(usec)} |")
    cpu_all = [r.redis_cpu_us for r in runs if r.ledger == "redis" and r.redis_cpu_us]
    busiest = max((r for r in runs if r.ledger == "redis"), key=lambda r: r.callers, default=None)
    top = ""
    if cpu_all and busiest is not None:
        per_send = statistics.median([r.redis_cpu_us for r in runs if r.ledger == "redis"
                                      and r.callers == busiest.callers and r.redis_cpu_us] or cpu_all)
        ceiling = 1e6 / per_send
        top = f"""
**Where one Redis tops out.** Redis runs the ledger's scripts on one thread. Each send (a claim and
a completion, two `EVALSHA`) cost that thread {per_send:.0f} µs of CPU in the busiest run above
(`used_cpu_sys` + `used_cpu_user` over the run, on a server holding nothing but the ledger, so the
figure includes the command parsing and socket work around the scripts). One core then serves at
most about **{ceiling:,.0f} sends/s** (1 s / {per_send:.0f} µs), {ceiling * 86400 / 1e6:,.0f} million a day,
whatever the callers; here the callers share the machine's two cores with Redis, so the rates above
are bounded by the clients first (more callers only add contention). 10 million emails a day is
116/s on average; a campaign's peak is what to compare with {ceiling:,.0f}/s.

**What Redis Cluster buys.** The ledger spreads its keys over `buckets` hash-tagged buckets
({buckets} by default, up to 256), each script touching one bucket's slot. On a cluster the buckets
are spread over the masters, so claims and completions scale with the number of masters, up to the
number of buckets: N masters serve about N x {ceiling:,.0f} sends/s. Nothing on the hot path crosses
buckets (a claim batch is pipelined per node); listing, stats and purge visit every bucket.
"""
    return f"""## Ledger capacity: claims and completions per second (`make bench`)

```
{command}
```

Run on {facts}; wall time {seconds / 60:.1f} min.

{repeat} repetition(s); about {ops:,} claim+complete pairs per run, on new keys; **median (min-max)**.

Callers are forked processes (at most 8), each with threads sharing one ledger object (and, for
PostgreSQL, a pool of as many connections as it has threads), all starting at one signal once
connected. A "send" here is one `claim` of a new key and its `complete`: the ledger work of a first
send, nothing else. The Redis ledger runs on a Redis server of the benchmark's own that holds
nothing else, so its `INFO cpu` and `INFO commandstats` deltas over a run are the ledger's alone.

{chr(10).join(lines)}
{top}"""


# -- one large campaign --


@dataclass
class BulkRun:
    """One campaign, end to end."""

    ledger: str
    recipients: int
    batch: int
    wall: float = 0.0
    round_trips: int = 0
    posts: int = 0
    delivered_keys: int = 0
    duplicates: int = 0
    suppressed: int = 0
    states: dict[str, int] = field(default_factory=dict)
    killed_at: int = 0
    kill_to_done: float = 0.0
    completed_runs: int = 0
    retried_runs: int = 0
    most_at_once: int = 0
    lease: float = 0.0
    visibility_timeout: float = 0.0


def _holder(led: Ledger, workers: list[WorkerProcess]) -> WorkerProcess | None:
    """The worker whose pool child holds a claim right now (its pid is in the claim's owner)."""
    pids = set()
    for record in led.iter_records(State.CLAIMED):
        parts = record.owner.split(":")
        if len(parts) > 1 and parts[1].isdigit():
            pids.add(int(parts[1]))
    for w in workers:
        if pids & set(w.pool_children()):
            return w
    return None


def bulk_run(h: Harness, provider: FakeProvider, ledger: str, ledger_redis: str, recipients: int, batch: int,
             kill_at: float, lease: float, visibility_timeout: float,
             progress: Callable[[str], None] = print) -> BulkRun:
    """``send_campaign`` of ``recipients`` new addresses; a whole worker SIGKILLed at ``kill_at`` settled."""
    mid = f"bulk{ledger[:2]}{uuid.uuid4().hex[:4]}"
    extra: dict[str, str] = {}
    if ledger == "postgresql":
        url, options = h.ledger_config("idem-pg", mid)
    else:
        url, options = ledger_redis, {"prefix": f"{h.ns}.{mid}.led"}
        extra["BENCH_COUNT_LEDGER"] = str(redis.Redis.from_url(ledger_redis).connection_pool.connection_kwargs["port"])
    led = from_url(url, **options)
    led.ping()
    provider.latency = 0.0
    provider.dedupe = True  # as a real provider: a resend under the same key is answered, not delivered
    provider.reset()
    keys = h.benchapp.keys(mid)
    h.queue[0] = f"{h.ns}.{mid}"
    env = h.worker_env(mid, url, options, BENCH_WINDOW="1,2", BENCH_PROVIDER_URL=provider.url,
                       BENCH_RESULT_BACKEND=h.result_backend, BENCH_LEASE=str(lease),
                       BENCH_VISIBILITY_TIMEOUT=str(visibility_timeout), **extra)
    workers = [WorkerProcess(f"{h.ns}-{mid}-w{i}", "bench.benchapp", ["-P", "prefork", "-c", "2", "-Q", h.queue[0]],
                             env, h.tmp) for i in range(2)]
    run = BulkRun(ledger, recipients, batch, lease=lease, visibility_timeout=visibility_timeout)
    try:
        for w in workers:
            w.start()
        addresses = [f"r{i}.{mid}@example.com" for i in range(recipients)]
        t0 = time.monotonic()
        h.app.tasks[CAMPAIGN_TASK].delay(campaign_id=mid, recipients=addresses, subject=SUBJECT, text=TEXT,
                                         batch_size=batch)
        killed_t = 0.0
        deadline = t0 + h.args.timeout * 10
        while True:
            counts = led.stats()
            settled = counts["sent"] + counts["failed"] + counts["review"]
            if settled >= recipients and not counts["claimed"] and not counts["released"]:
                break
            if not killed_t and settled >= recipients * kill_at:
                victim = _holder(led, workers)
                if victim is not None:
                    victim.kill()
                    h.r.decr(f"{keys['count']}.campaign_running")  # the run it killed never ends
                    killed_t, run.killed_at = time.monotonic(), settled
                    progress(f"bulk {ledger}: SIGKILLed worker {victim.name} at {settled:,} settled "
                             f"({time.monotonic() - t0:.0f} s)")
                    victim.start()
            if time.monotonic() > deadline:
                raise RuntimeError(f"bulk {ledger}: {settled:,} of {recipients:,} settled after "
                                   f"{time.monotonic() - t0:.0f}s; see {h.tmp}")
            time.sleep(0.5)
        run.wall = time.monotonic() - t0
        run.kill_to_done = time.monotonic() - killed_t if killed_t else 0.0
        run.states = {k: v for k, v in counts.items() if v}
        # The campaign run that settled the last recipient flushes its round-trip count when it returns.
        wait_until(lambda: int(h.r.get(f"{keys['count']}.io") or 0) >= 1, timeout=120)
        run.completed_runs = int(h.r.get(f"{keys['count']}.io") or 0)
        run.retried_runs = int(h.r.get(f"{keys['count']}.not_success") or 0)
        run.most_at_once = int(h.r.get(f"{keys['count']}.campaign_max") or 0)
    finally:
        for w in workers:
            w.stop()
        led.close()
    run.round_trips = int(h.r.get(f"{keys['count']}.ledger_rt") or 0)
    stats = provider.stats()
    per_key = stats["per_key"]
    run.posts = stats["attempts"]
    run.suppressed = stats["suppressed"]
    run.delivered_keys = sum(1 for v in per_key.values() if v["deliveries"])
    run.duplicates = sum(max(0, v["deliveries"] - 1) for v in per_key.values())
    return run


def bulk_section(runs: list[BulkRun], command: str, facts: str, seconds: float) -> str:
    lines = ["| ledger | recipients | batch | wall s | recipients/s | ledger round trips (per recipient) "
             "| POSTs | recipients delivered | duplicates | resends answered by the provider's de-duplication "
             "| final states | campaign task runs | most runs at once |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in runs:
        states = ", ".join(f"{k} {v:,}" for k, v in sorted(r.states.items()))
        lines.append(f"| {r.ledger} | {r.recipients:,} | {r.batch} | {r.wall:,.0f} | {r.recipients / r.wall:,.0f} "
                     f"| {r.round_trips:,} ({r.round_trips / r.recipients:.3f}) | {r.posts:,} | {r.delivered_keys:,} "
                     f"| {r.duplicates} | {r.suppressed} | {states} "
                     f"| {r.completed_runs} completed, {r.retried_runs} handed on or retried"
                     f"{', 1 killed' if r.killed_at else ''} | {r.most_at_once} |")
    notes = "\n".join(
        f"* {r.ledger}: the worker running the campaign was SIGKILLed (whole process group) at {r.killed_at:,} "
        f"recipients settled and restarted; the campaign message came back after the Redis transport's "
        f"`visibility_timeout` ({r.visibility_timeout:.0f} s here) and every recipient was settled "
        f"{r.kill_to_done:.0f} s after the kill (lease {r.lease:.0f} s)." if r.killed_at else
        f"* {r.ledger}: no claim was held at the moment chosen for the kill; the run went without one."
        for r in runs)
    return f"""## A 100,000-recipient campaign, end to end (`make bench`)

```
{command}
```

Run on {facts}; wall time {seconds / 60:.1f} min.

One `send_campaign.delay(campaign_id=..., recipients=[...], subject=..., text=..., batch_size=...)` from
the benchmark process; two workers (`-P prefork -c 2`) on the Redis broker; the fake provider
answering at once and de-duplicating on `Idempotency-Key` as a real one does. Wall time runs from
the `delay()` to the ledger holding every recipient in a final state (nothing `claimed` or
`released`). Ledger round trips are counted in the workers at the client: every request written to
the ledger's own Redis server (a pipeline of claims is one), or every SQL statement; a SIGKILLed
process loses what it had not yet added (under 100 Redis requests, under 500 statements).
Deliveries are the provider's own records per key. A campaign pass runs for at most half the
transport's `visibility_timeout`, then publishes the next pass, which starts where it stopped
(`idemmail_campaign_pass_seconds`): "handed on or retried" counts those passes, and "most runs at once"
the most campaign runs under way at one moment (more than 1 would be a copy the broker handed out
again while the first still ran).

{chr(10).join(lines)}

{notes}

A recipient's send that was under way when its worker died reached the provider (or not) without
being recorded; the next run of the campaign reclaims it once its lease has run out and sends it
again under the same key, which the provider answers from its de-duplication (the column above)
instead of delivering twice. With a provider that does not de-duplicate, such a recipient is
parked for review instead (see `make chaos`).
"""


def shuffled(items: list[Any], rng: random.Random) -> list[Any]:
    out = list(items)
    rng.shuffle(out)
    return out
