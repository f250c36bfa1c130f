"""The command line of the simulator.

``python -m sim`` (``make sim``): the saved traces replayed, every world of :data:`~sim.worlds.EXHAUSTIVE`
explored exhaustively, ``--random`` seeded random walks over :data:`~sim.worlds.RANDOM` (and a smaller
share over the real SQLite ledger), and every planted defect hunted; two processes. A violation is
shrunk, printed with its steps and saved under ``sim/traces/found/`` (move it to ``sim/traces/`` to keep
it as a regression test). The last line is ``sim: <S> schedules, <V> violations, planted defects caught
<c>/<n>``; the exit status is 1 unless there were no violations and every defect was caught.

``--budget SECONDS`` scales everything down to about that long (``make check`` runs 30 s); ``--coverage``
reruns it under coverage.py and prints the branches of the state machine (handler.py, rotation.py, steps.py,
chain.py) and of the campaign code (bulk.py) the schedules reached.
``python -m sim replay TRACE [--shrink]`` prints a saved schedule step by step.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .defects import DEFECTS, planted
from .explore import exhaustive, hunt, load, replay, run, save, shrink, simulating, walker
from .world import Config
from .worlds import EXHAUSTIVE, RANDOM, SQLITE

HERE = Path(__file__).parent
TRACES = HERE / "traces"
FOUND = TRACES / "found"
#: Each defect must be caught within this long (issue 36).
DEFECT_SECONDS = 60.0
COVERED = ("idemmail_celery/handler.py", "idemmail_celery/rotation.py", "idemmail_celery/steps.py",
           "idemmail_celery/chain.py", "idemmail_celery/bulk.py")


@dataclass
class Tally:
    schedules: int = 0
    violations: int = 0
    seconds: float = 0.0
    found: list[tuple[str, str]] | None = None  # (trace file, first violation)

    def add(self, other: Tally) -> None:
        self.schedules += other.schedules
        self.violations += other.violations
        self.seconds = max(self.seconds, other.seconds)
        self.found = [*(self.found or []), *(other.found or [])]


def _report(cfg: Config, choices: list[int], violations: list[str], name: str, seed: int | None) -> str:
    small = shrink(cfg, choices)
    out = replay(cfg, small, keep=True)
    path = FOUND / f"{name}.json"
    save(cfg, small, out.violations or violations, path, seed=seed)
    print(f"\nVIOLATION in {name} (seed {seed}): {(out.violations or violations)[0]}", flush=True)
    print(f"  replay: python -m sim replay {path}   ({len(small)} choices, shrunk from {len(choices)})")
    for n, line in enumerate(out.log[-40:]):
        print(f"  {n:4d} {line}")
    return str(path)


def _exhaustive_job(args: tuple[int, Config, float]) -> Tally:
    index, cfg, seconds = args
    tally = Tally(found=[])
    started = time.monotonic()
    with simulating():
        for out in exhaustive(cfg):
            tally.schedules += 1
            if out.violations:
                tally.violations += 1
                if len(tally.found or []) < 3:
                    tally.found = [*(tally.found or []), (_report(cfg, out.choices, out.violations,
                                                                  f"exhaustive-{index}-{tally.schedules}", None),
                                                          out.violations[0])]
            if time.monotonic() - started > seconds:
                print(f"sim: exhaustive world {index} cut at {tally.schedules} schedules (its time is up)",
                      flush=True)
                break
    tally.seconds = time.monotonic() - started
    return tally


def _random_job(args: tuple[int, int, int, list[Config], float]) -> Tally:
    _worker, first, count, worlds, seconds = args
    tally = Tally(found=[])
    started = time.monotonic()
    with simulating():
        for seed in range(first, first + count):
            cfg = worlds[seed % len(worlds)]
            out = run(cfg, walker(seed))
            tally.schedules += 1
            if out.violations:
                tally.violations += 1
                if len(tally.found or []) < 3:
                    name = f"random-{RANDOM.index(cfg) if cfg in RANDOM else 'sqlite'}-{seed}"
                    tally.found = [*(tally.found or []), (_report(cfg, out.choices, out.violations, name, seed),
                                                          out.violations[0])]
            if time.monotonic() - started > seconds:
                break
    tally.seconds = time.monotonic() - started
    return tally


def _defect_job(args: tuple[int, float]) -> tuple[str, bool, int, float]:
    index, seconds = args
    defect = DEFECTS[index]
    started = time.monotonic()
    with simulating(), planted(defect):
        found = hunt(defect.worlds, seconds=seconds, seed=index * 1000)
    return defect.name, found is not None, found[2] if found else 0, time.monotonic() - started


def _replay_traces() -> Tally:
    tally = Tally(found=[])
    with simulating():
        for path in sorted(TRACES.glob("*.json")):
            cfg, choices, _ = load(path)
            out = replay(cfg, choices)
            tally.schedules += 1
            if out.violations:
                tally.violations += 1
                tally.found = [*(tally.found or []), (str(path), out.violations[0])]
                print(f"sim: saved trace {path.name} breaks again: {out.violations[0]}", flush=True)
    return tally


def explore(budget: float | None, randoms: int, processes: int) -> int:
    """Everything ``make sim`` runs; returns the exit status."""
    started = time.monotonic()
    scale = 1.0 if budget is None else budget / 540.0
    total = Tally(found=[])
    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        traces = _replay_traces()
        total.add(traces)
        print(f"sim: {traces.schedules} saved traces replayed, {traces.violations} violations", flush=True)

        t0 = time.monotonic()
        per_world = (60.0 if budget is None else max(1.0, budget * 0.25 / len(EXHAUSTIVE) * processes))
        ex = Tally(found=[])
        for tally in pool.imap_unordered(_exhaustive_job, [(i, c, per_world) for i, c in enumerate(EXHAUSTIVE)]):
            ex.add(tally)
        total.add(ex)
        took = time.monotonic() - t0
        print(f"sim: exhaustive: {len(EXHAUSTIVE)} worlds, {ex.schedules} schedules in {took:.0f} s "
              f"({ex.schedules / max(took, 1e-9):.0f}/s), {ex.violations} violations", flush=True)

        t0 = time.monotonic()
        count = randoms if budget is None else max(50, int(randoms * scale * 0.5))
        seconds = 420.0 if budget is None else budget * 0.4
        # Campaign worlds cost several times a single send's: they get one seed in four of their share.
        worlds = [c for c in RANDOM if not c.campaign] * 3 + [c for c in RANDOM if c.campaign]
        share = count // processes
        jobs = [(w, w * share, share + (count % processes if w == processes - 1 else 0), worlds, seconds)
                for w in range(processes)]
        rnd = Tally(found=[])
        for tally in pool.imap_unordered(_random_job, jobs):
            rnd.add(tally)
        sq = Tally(found=[])
        sq_count = max(4, count // 200)
        for tally in pool.imap_unordered(_random_job, [(w, 10**6 + w * sq_count, sq_count, list(SQLITE),
                                                        seconds / 8) for w in range(processes)]):
            sq.add(tally)
        total.add(rnd)
        total.add(sq)
        took = time.monotonic() - t0
        print(f"sim: random walks: {rnd.schedules} schedules over {len(RANDOM)} worlds (in-memory ledger) and "
              f"{sq.schedules} on the SQLite ledger in {took:.0f} s ({(rnd.schedules + sq.schedules) / took:.0f}/s), "
              f"{rnd.violations + sq.violations} violations", flush=True)
        if budget is None and rnd.schedules < randoms:
            print(f"sim: only {rnd.schedules} of {randoms} random schedules ran in the time", flush=True)
            total.violations += 0  # said above; the count stands as run

        t0 = time.monotonic()
        limit = DEFECT_SECONDS if budget is None else max(2.0, budget * 0.25 / len(DEFECTS) * processes)
        caught = 0
        for name, ok, tries, secs in pool.imap(_defect_job, [(i, limit) for i in range(len(DEFECTS))]):
            caught += ok
            print(f"sim: planted defect {name}: {'caught' if ok else 'MISSED'} after {tries} schedules "
                  f"({secs:.1f} s)", flush=True)
    finally:
        pool.close()
        pool.join()
    rate = total.schedules / max(time.monotonic() - started, 1e-9)
    print(f"sim: {time.monotonic() - started:.0f} s in all, {rate:.0f} schedules/s on {processes} processes")
    print(f"sim: {total.schedules} schedules, {total.violations} violations, planted defects caught "
          f"{caught}/{len(DEFECTS)}")
    return 0 if total.violations == 0 and caught == len(DEFECTS) else 1


def measure(argv: list[str]) -> int:
    """Run ``python -m sim ARGV`` under coverage.py (branches; the pool's processes too) and print the
    coverage of :data:`COVERED`, missed lines and branches included."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        rc = Path(tmp) / "coveragerc"
        rc.write_text("[run]\nbranch = True\nparallel = True\nconcurrency = greenlet, multiprocessing\n"
                      f"include = {', '.join(f'*/{p}' for p in COVERED)}\n")
        env = {**os.environ, "COVERAGE_FILE": str(Path(tmp) / ".coverage")}
        coverage = [sys.executable, "-m", "coverage"]
        status = subprocess.run([*coverage, "run", f"--rcfile={rc}", "-m", "sim", *argv], env=env,
                                check=False).returncode
        subprocess.run([*coverage, "combine", "-q", f"--rcfile={rc}"], env=env, check=True)
        print("sim: branch coverage of the code the schedules ran (coverage.py):", flush=True)
        subprocess.run([*coverage, "report", "-m", f"--rcfile={rc}"], env=env, check=True)
    return status


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=None, help="about this many seconds in all")
    parser.add_argument("--random", type=int, default=100_000, help="random schedules (default 100,000)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--coverage", action="store_true",
                        help="measure the branches of the state machine and the campaign code the schedules "
                             "reach (slower)")
    sub = parser.add_subparsers(dest="command")
    rep = sub.add_parser("replay", help="replay a saved trace and print its steps")
    rep.add_argument("trace", type=Path)
    rep.add_argument("--shrink", action="store_true", help="shrink it first (and write it back)")
    args = parser.parse_args(argv)
    if args.command == "replay":
        cfg, choices, data = load(args.trace)
        with simulating():
            if args.shrink:
                choices = shrink(cfg, choices)
                save(cfg, choices, replay(cfg, choices).violations, args.trace, seed=data.get("seed"))
            out = replay(cfg, choices, keep=True)
        for n, line in enumerate(out.log):
            print(f"{n:4d} {line}")
        print("violations:", out.violations or "none")
        return 1 if out.violations else 0
    if args.coverage:
        return measure([a for a in argv if a != "--coverage"])
    return explore(args.budget, args.random, max(1, args.processes))

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
