"""Where a worker's time per send goes: the task layer, the store's round trips, and the scripts' work.

``python -m bench.worker_path [--calls 3000] [--runs 3] [--url redis://...] [--ledger postgresql]``

The worker's path of the no-op bench tasks (:mod:`bench.benchapp`), timed in this process: each call
runs under a pushed request, as a worker's pool runs it (``called_directly`` off; for
``bench.idem`` the sealed headers ``apply_async`` would send), without the broker's fetch and
acknowledgement, which every variant pays alike. Variants, measured in alternation in every run:

==================  ==================================================================================
``plain``           the no-op body alone (one pipelined Redis round trip that stamps the completion)
``naive``           the hand-rolled floor: ``SET NX`` + body + ``SET``
``naive-null``      the same with the two ``SET``\\ s answered in process: its key's hash and the body
``idem``            ``IdempotentTask`` on the Redis ledger
``idem-constant``   the same with the claim and completion scripts cut short: each still checks the
                    ledger's epoch and reads the server's clock, then answers as for a new key
                    (``acquired``, ``ok``) without reading or writing the record: the round trips are
                    kept, the scripts' work is not
``idem-null``       the same with the store's claim and completion answered in process: the task
                    layer alone (seal, key, chain state, claim request, lease keeper, outcome, report)
==================  ==================================================================================

``--ledger postgresql``: ``IdempotentTask`` on the PostgreSQL ledger (``--postgres``), against its floor
``naive-pg`` (``bench.naive_pg``: ``INSERT ... ON CONFLICT DO NOTHING`` + body + ``UPDATE`` on a
two-column table); no ``idem-constant``, and the round trips are the two statements of each.

Per call, CPU (``time.process_time``) and wall time in µs, medians (min-max) over ``--runs``; then
the differences that split the gap between ``idem`` and the floor: the task layer (``idem-null``
minus ``naive-null``), the store's two round trips against the floor's two ``SET``\\ s (``idem`` minus
``idem-null``, against ``naive`` minus ``naive-null``), and the part of those that is the scripts' work
(``idem`` minus ``idem-constant``). Celery's own per-task work around the call (decoding the message,
``saferepr`` of the result, the acknowledgement) is not in these figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import uuid
from typing import Any

from bench.cleanup import delete_matching, dropped, run_sql

VARIANTS = {"redis": ("plain", "naive", "naive-null", "idem", "idem-constant", "idem-null"),
            "postgresql": ("plain", "naive-pg", "naive-null", "idem", "idem-null")}
#: The task each variant calls (``-null`` and ``-constant``: the same task, with its store answered or cut).
TASK_OF = {"plain": "bench.plain", "naive": "bench.naive", "naive-null": "bench.naive", "naive-pg": "bench.naive_pg",
           "idem": "bench.idem", "idem-constant": "bench.idem", "idem-null": "bench.idem"}

#: Inserted after each hot script's epoch check: the round trip and the checks stay, the work goes.
_CUT = {
    "claim": ("if lost(KEYS[4]) then return {'lost'} end\n",
              "do local n = now(); return {'acquired', n, n + tonumber(ARGV[5]) * 1000} end\n"),
    "finish": ("if lost() then return {'lost'} end\n", "do return {'ok', now()} end\n"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.worker_path", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="calls per variant and run (default 3000)")
    p.add_argument("--runs", type=int, default=3, help="runs, each variant once per run (default 3)")
    p.add_argument("--url", default=os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"),
                   help="Redis for the ledger and the bench's stamps (default: BENCH_REDIS or the local one)")
    p.add_argument("--ledger", choices=sorted(VARIANTS), default="redis", help="the ledger measured (default redis)")
    p.add_argument("--postgres", default=os.environ.get("BENCH_POSTGRES",
                                                        "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
                   help="--ledger postgresql: the database (default: BENCH_POSTGRES or the local one)")
    args = p.parse_args(argv)
    ns = f"wpath{uuid.uuid4().hex[:8]}"
    if args.ledger == "postgresql":
        ledger_url, options = args.postgres, f'{{"table": "{ns}"}}'
    else:
        ledger_url, options = args.url, f'{{"prefix": "{ns}.led"}}'
    # bench.benchapp reads its namespace and ledger from the environment when imported.
    os.environ.update(BENCH_NS=ns, BENCH_RUN="w", BENCH_REDIS=args.url, BENCH_LEDGER=ledger_url,
                      BENCH_LEDGER_OPTIONS=options)
    from bench import benchapp

    floor_table = f"{ns}_floor"
    try:
        if args.ledger == "postgresql":
            run_sql(args.postgres, benchapp.FLOOR_TABLE_DDL.format(table=floor_table))
        results = _measure(benchapp, ns, args.ledger, floor_table, args.calls, args.runs)
    finally:
        delete_matching(benchapp._r, f"{ns}*")
        if args.ledger == "postgresql":
            run_sql(args.postgres, *dropped([ns, floor_table]))
    _print(results, args.ledger, args.calls, args.runs)
    return 0


def _measure(benchapp: Any, ns: str, ledger: str, floor_table: str, calls: int,
             runs: int) -> dict[str, list[tuple[float, float]]]:
    app = benchapp.app
    idem = app.tasks["bench.idem"]
    backend = idem.handler.ledger.backend  # opens the ledger (its scripts loaded, its table made) outside the timing
    real = {"_finish": backend._finish, "store_claim": backend.claim, "set": benchapp._r.set,
            "options": app.conf.idemmail_ledger_options}
    cut: dict[str, Any] = {}
    if ledger == "redis":
        from idemmail_celery.ledger.redis import _lua

        real.update(claim=backend.scripts["claim"], finish=backend.scripts["finish"])
        for name, (at, early) in _CUT.items():
            text = _lua(name)
            if at not in text:  # the script changed: a silent full script would be measured as a cut one
                raise SystemExit(f"bench.worker_path: {name}.lua no longer has the line {at.strip()!r} to cut after")
            cut[name] = backend.client.register_script(text.replace(at, at + early, 1))
    answered: dict[str, Any] = {}

    def claim_in_process(request: Any) -> Any:
        # The first claim is a real one: its answer, re-keyed, answers every later one.
        first = answered.get("claim")
        if first is None:
            first = answered["claim"] = real["store_claim"](request)
            return first
        return dataclasses.replace(first, record=dataclasses.replace(first.record, key=request.key))

    def setup(variant: str) -> None:
        if cut:
            backend.scripts["claim"], backend.scripts["finish"] = real["claim"], real["finish"]
        backend.claim, backend._finish, benchapp._r.set = real["store_claim"], real["_finish"], real["set"]
        app.conf.idemmail_ledger_options = real["options"]
        if variant == "naive-pg":  # its own two-column table (it reads the name from the ledger's options)
            app.conf.idemmail_ledger_options = {"table": floor_table}
        elif variant == "idem-constant":
            backend.scripts["claim"], backend.scripts["finish"] = cut["claim"], cut["finish"]
        elif variant == "idem-null":
            backend.claim = claim_in_process
            backend._finish = lambda *_a, **_k: time.time()
        elif variant == "naive-null":
            benchapp._r.set = lambda *_a, **_k: True

    def one(variant: str, tag: str) -> tuple[float, float]:
        task = app.tasks[TASK_OF[variant]]
        prepared = []
        for i in range(calls):
            call_args = (f"u{i}.{tag}.{ns}@example.com", i)
            headers = task.intent_headers(call_args, {}) if task is idem else {}
            prepared.append((call_args, {"id": str(uuid.uuid4()), "headers": headers, "delivery_info": {},
                                         "hostname": "worker-path", "called_directly": False, **headers}))
        setup(variant)
        try:
            return _timed(task, prepared)
        finally:
            setup("")

    variants = VARIANTS[ledger]
    one("idem", "warm")
    one(variants[1], "warm")
    results: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for r in range(runs):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            results[variant].append(one(variant, f"{r}{variant}"))
    return results


def _timed(task: Any, prepared: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> tuple[float, float]:
    push, pop = task.push_request, task.pop_request
    c0, t0 = time.process_time(), time.perf_counter()
    for call_args, request in prepared:
        push(**request)
        try:
            task(*call_args)
        finally:
            pop()
    n = len(prepared)
    return (time.process_time() - c0) / n * 1e6, (time.perf_counter() - t0) / n * 1e6


def _print(results: dict[str, list[tuple[float, float]]], ledger: str, calls: int, runs: int) -> None:
    def med(variant: str, i: int) -> float:
        return statistics.median(x[i] for x in results[variant])

    print(f"{ledger} ledger: {calls} calls x {runs} runs per variant, µs per call, median (min-max)")
    print(f"{'variant':15} {'CPU':>22} {'wall':>22}")
    for v in results:
        cells = [f"{med(v, i):6.0f} ({min(x[i] for x in results[v]):.0f}-{max(x[i] for x in results[v]):.0f})"
                 for i in (0, 1)]
        print(f"{v:15} {cells[0]:>22} {cells[1]:>22}")
    floor = "naive" if ledger == "redis" else "naive-pg"
    lines = [("task layer (idem-null - naive-null)", "idem-null", "naive-null"),
             ("ledger round trips (idem - idem-null)", "idem", "idem-null"),
             (f"floor's round trips ({floor} - naive-null)", floor, "naive-null"),
             ("scripts' work (idem - idem-constant)", "idem", "idem-constant"),
             (f"whole gap (idem - {floor})", "idem", floor)]
    print("split of the gap to the floor (CPU / wall):")
    for label, a, b in lines:
        if a in results and b in results:
            print(f"  {label:47} {med(a, 0) - med(b, 0):+6.0f} / {med(a, 1) - med(b, 1):+6.0f}")


if __name__ == "__main__":
    sys.exit(main())
