"""``make demo``: the exactly-once guarantee on a real Celery worker, with no servers.

The broker, result backend and ledger are files under ``.demo/`` (wiped at start):
see ``examples/demo_app.py``. The script starts ``celery worker -P prefork -c 2``,
then

1. enqueues the same receipt three times in different forms, plus another order;
2. waits for the four results: one ``sent`` and two ``duplicate`` for the first order;
3. counts the outbox (one line per intent) and prints the ledger;
4. crashes a worker process right after a send, before the ledger hears of it:
   the redelivered message (``acks_late``) waits out the lease, then parks the
   intent as ``review`` instead of sending it again.

Exit code 0 only if every count is as expected.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from idemmail_celery.ledger import from_url

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / ".demo"  # must match examples/demo_app.py
RESULT_TIMEOUT = 20.0
WORKER_START_TIMEOUT = 30.0

BODY = "Thanks for your order!"


class Demo:
    def __init__(self) -> None:
        sys.path.insert(0, str(ROOT))
        from examples import demo_app  # after the wipe: it creates its folders on import

        self.app = demo_app
        self.task: Any = demo_app.send_receipt
        self.problems: list[str] = []
        self.worker: subprocess.Popen[bytes] | None = None
        self.ledger = from_url(demo_app.LEDGER_URL)

    # -- helpers --

    def check(self, ok: bool, what: str) -> None:
        print(f"   {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.problems.append(what)

    def outbox(self) -> list[dict[str, Any]]:
        if not self.app.OUTBOX.exists():
            return []
        lines = self.app.OUTBOX.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def wait(self, result: Any) -> Any:
        """The task's return value, or the exception it raised; None on timeout."""
        try:
            return result.get(timeout=RESULT_TIMEOUT, interval=0.1, propagate=False)
        except Exception as exc:  # celery.exceptions.TimeoutError
            self.problems.append(f"no result for {result.id} within {RESULT_TIMEOUT:.0f}s ({type(exc).__name__})")
            return None

    # -- the worker --

    def start_worker(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        log = (DEMO_DIR / "worker.log").open("wb")
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "examples.demo_app", "worker",
             "-P", "prefork", "-c", "2", "-l", "info", "-n", f"demo-{os.getpid()}@%h",
             "--without-mingle", "--without-gossip", "--without-heartbeat"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so stop_worker can reap the pool too
        )
        log.close()
        deadline = time.monotonic() + WORKER_START_TIMEOUT
        while not self.app.READY_FLAG.exists():
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.worker.returncode}; see .demo/worker.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker was not ready within {WORKER_START_TIMEOUT:.0f}s")
            time.sleep(0.1)
        print(f"worker up: celery -A examples.demo_app worker -P prefork -c 2 (pid {self.worker.pid})")

    def stop_worker(self) -> None:
        worker = self.worker
        if worker is None:
            return
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)  # warm shutdown
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)  # whatever is left of the group we started
        worker.wait()
        print("worker stopped")

    # -- the scenes --

    def scene_duplicates(self) -> None:
        print("\n1. Enqueue the same receipt three ways, plus a second order")
        # Addresses are normalised (display name dropped, domain lower-cased); the local part is case-sensitive.
        calls: list[tuple[str, int, tuple[Any, ...], dict[str, Any]]] = [
            ("positional", 1001, ("ANN@example.com", 1001, BODY), {}),
            ("keywords", 1001, (), {"to": "ANN@example.com", "order_id": 1001, "body": BODY}),
            ("display name", 1001, ("Ann <ANN@Example.com>",), {"order_id": 1001, "body": BODY}),
            ("other order", 1002, ("ANN@example.com", 1002, BODY), {}),
        ]
        sent = []
        for label, order_id, args, kwargs in calls:
            shown = ", ".join([*(repr(a) for a in args[:2]), *(f"{k}={v!r}" for k, v in kwargs.items() if k != "body")])
            key = self.task.intent_key(*args, **kwargs)
            sent.append((label, order_id, self.task.apply_async(args, kwargs)))
            print(f"   {label:<13} send_receipt({shown}, body=...)  key {key[:12]}")

        print("\n2. Results from the worker")
        outcomes: dict[int, list[dict[str, Any]]] = {1001: [], 1002: []}
        for label, order_id, result in sent:
            value = self.wait(result)
            if isinstance(value, dict):
                print(f"   {label:<13} order {order_id}: {value['status']:<9} message_id {value['message_id']}")
                outcomes[order_id].append(value)
            else:
                print(f"   {label:<13} order {order_id}: {value!r}")
        first = outcomes[1001]
        self.check(sorted(v["status"] for v in first) == ["duplicate", "duplicate", "sent"],
                   "order 1001: 1 sent, 2 duplicate")
        self.check(len(first) == 3 and len({v["message_id"] for v in first}) == 1,
                   "order 1001: every copy reports the same message_id")
        self.check([v["status"] for v in outcomes[1002]] == ["sent"], "order 1002: 1 sent")

        print("\n3. What actually happened")
        lines = self.outbox()
        print(f"   outbox.jsonl: {len(lines)} lines")
        for line in lines:
            print(f"     key {line['key'][:12]}  to {line['to']!r}  order {line['order_id']}  {line['message_id']}")
        self.check(len(lines) == 2, "outbox: 2 lines, one per intent")
        self.print_ledger()

    def scene_crash(self) -> None:
        print(f"\n4. Crash after the send, before the ledger hears of it (lease {self.app.LEASE_SECONDS}s)")
        args = ("bob@example.com", 2001, BODY)
        key = self.task.intent_key(*args)
        self.app.CRASH_FLAG.touch()
        started = time.monotonic()
        result = self.task.apply_async(args)
        print(f"   send_receipt('bob@example.com', 2001, body=...)  key {key[:12]}")
        print("   the worker process will SIGKILL itself right after writing to the outbox")
        value = self.wait(result)
        took = time.monotonic() - started
        ours = [line for line in self.outbox() if line["key"] == key]
        if ours:
            pid = ours[0]["pid"]
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            print(f"   the send went out (pid {pid} wrote {ours[0]['message_id']}), and pid {pid} is "
                  f"{'still alive?!' if alive else 'gone'}")
        reason = getattr(value, "reason", "")
        print(f"   redelivered copy finished after {took:.1f}s: {type(value).__name__} (reason {reason!r})")
        record = self.ledger.get(key)
        state = record.state.value if record else None
        print(f"   outbox.jsonl: {len(ours)} line for this intent; ledger state: {state}")
        self.check(type(value).__name__ == "SendNeedsReview", "the redelivered copy raised SendNeedsReview")
        self.check(len(ours) == 1, "outbox: 1 line for the crashed intent (not sent again)")
        self.check(state == "review", "ledger: the crashed intent is parked as review")

        again = self.wait(self.task.apply_async(args))
        after = sum(1 for line in self.outbox() if line["key"] == key)
        print(f"   enqueue it once more: {type(again).__name__}; outbox still {after} line for this intent")
        self.check(after == 1 and type(again).__name__ == "SendNeedsReview",
                   "a later copy replays review and does not send")
        self.print_ledger()

    def print_ledger(self) -> None:
        records = list(self.ledger.iter_records())
        print(f"   ledger .demo/ledger.sqlite3: {len(records)} records")
        for r in sorted(records, key=lambda r: r.created_at):
            detail = (r.result or {}).get("message_id") or (r.error or {}).get("reason")
            print(f"     key {r.key[:12]}  {r.state.value:<7} attempts {r.attempts}  reclaims {r.reclaims}  {detail}")


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # live output through pipes
    started = time.monotonic()
    shutil.rmtree(DEMO_DIR, ignore_errors=True)
    DEMO_DIR.mkdir()
    demo = Demo()
    try:
        demo.start_worker()
        demo.scene_duplicates()
        demo.scene_crash()
    except Exception as exc:
        demo.problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        demo.stop_worker()
        demo.ledger.close()
    took = time.monotonic() - started
    lines = demo.outbox()
    total, intents = len(lines), len({line["key"] for line in lines})
    if (total, intents) != (3, 3):
        demo.problems.append(f"outbox: expected 3 lines for 3 intents, found {total} lines for {intents} intents")
    if demo.problems:
        print(f"\nRESULT: FAILED after {took:.1f}s ({total} outbox lines); see .demo/worker.log")
        for problem in demo.problems:
            print(f"  - {problem}")
        return 1
    print(f"\nRESULT: OK in {took:.1f}s: {intents} intents, {total} outbox lines: each intent sent exactly once,"
          " the crashed one parked for review instead of sent twice")
    return 0


if __name__ == "__main__":
    sys.exit(main())
