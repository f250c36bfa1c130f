"""What operators see: Flower's API over a real worker and Redis broker, the metrics endpoint, the log.

Each test starts its own worker (and Flower) on its own queue and ledger prefix.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

from ..conftest import free_port, wait_for
from .conftest import ROOT, results

ADDRESS = "ann@example.com"


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
        return body


class Flower:
    """``celery flower`` on a loopback port, watching the test's app; its HTTP API as dicts."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.integration.workerapp", "flower",
                 f"--port={self.port}", "--address=127.0.0.1"],
                cwd=ROOT, env={**env, "FLOWER_UNAUTHENTICATED_API": "true"}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._up, timeout=30, interval=0.2)

    def _up(self) -> bool:
        try:
            self.get("/api/tasks?limit=1")
        except OSError:
            assert self.proc.poll() is None, "flower exited"
            return False
        return True

    def get(self, path: str) -> Any:
        return json.loads(http_get(f"http://127.0.0.1:{self.port}{path}"))

    def task(self, task_id: str) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = self.get(f"/api/task/info/{task_id}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return info

    def wait_state(self, task_id: str, state: str, timeout: float = 30) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            info = self.task(task_id)
            return info if info and info["state"] == state else None

        found: dict[str, Any] = wait_for(seen, timeout=timeout, interval=0.2)  # type: ignore[assignment]
        return found

    def stop(self) -> None:
        # SIGKILL: Flower keeps no state here, and its SIGTERM handler can be swallowed (then it never exits).
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)


@pytest.fixture
def flower(worker_env: dict[str, str], tmp_path: Path) -> Iterator[Flower]:
    f = Flower(worker_env, tmp_path / "flower.log")
    try:
        yield f
    finally:
        f.stop()


def flower_watching(flower: Flower, app: Any) -> None:
    """Flower only sees events sent after it subscribed: ping until it has seen one."""
    def seen() -> bool:
        ping = app.send_task("celery.accumulate", args=[1])
        ping.get(timeout=10)
        time.sleep(0.3)
        return flower.task(ping.id) is not None

    wait_for(seen, timeout=30, interval=0.1)


def test_flower_shows_sent_duplicate_review_and_in_flight_retry(
    fake_provider: FakeProvider, worker_env: dict[str, str], request: pytest.FixtureRequest, sink: Any,
    start_worker: Callable[..., Any], flower: Flower,
) -> None:
    worker_env.update(IDEMMAIL_TEST_PROVIDER=fake_provider.url, IDEMMAIL_TEST_PROVIDER_KEY=DEFAULT_API_KEY)
    app_module = request.getfixturevalue("app_module")
    worker = start_worker("-P", "prefork", "-c", "2", "-E")
    flower_watching(flower, app_module.app)
    send = app_module.send

    first = send.delay(ADDRESS, 1)
    first.get(timeout=30)
    second = send.delay(ADDRESS, 1)
    key = second.get(timeout=30)["key"]

    shown = flower.wait_state(second.id, "SUCCESS")
    assert "'status': 'duplicate'" in shown["result"]
    assert key in shown["result"] and "'message_id': 'msg-1'" in shown["result"]
    assert "'status': 'sent'" in flower.wait_state(first.id, "SUCCESS")["result"]

    # Review: the outcome is unknown and nothing downstream de-duplicates.
    sink.push_failure("ambiguous")
    parked = send.delay("bob@example.com", 2)
    results([parked])
    shown = flower.wait_state(parked.id, "FAILURE")
    assert shown["exception"].startswith("SendNeedsReview(") and "'timeout'" in shown["exception"]
    assert "'status': 'review'" in shown["result"]  # from the task-idemmail event

    # In flight: the second copy finds the first one's live claim, is retried, then replays it.
    # The holder holds until the test has seen the copy rescheduled: no timing window.
    sink.control("hold_until_released", "1")
    holder = send.delay("cat@example.com", 3)
    wait_for(lambda: sink.r.llen(sink.k("holding")) >= 1, timeout=20)  # the holder's body is running
    copy = send.delay("cat@example.com", 3)
    # Seen retried (its state cycles RETRY, RECEIVED, ... while it is rescheduled): then release the holder.
    wait_for(lambda: (flower.task(copy.id) or {}).get("retried") is not None, timeout=30, interval=0.1)
    reasons = [(flower.task(copy.id) or {}).get("exception") or ""]
    sink.control("release", "1")
    outcomes = results([holder, copy])
    assert [o["status"] for o in outcomes] == ["sent", "duplicate"]
    shown = flower.wait_state(copy.id, "SUCCESS")
    assert shown["retried"] is not None
    # The reschedule's reason while it waited, said once (the key, not "in_flight: in_flight:"), never Celery's
    # Retry(Retry(...)); gone once the copy succeeded (before, Flower kept it listed on the SUCCESS task).
    assert reasons and reasons[0].startswith(f"IdempotencyInFlightError('{outcomes[1]['key']} held by another worker")
    assert shown.get("exception") in (None, ""), shown.get("exception")
    assert "'status': 'duplicate'" in shown["result"]

    # send_email twice: Flower shows the outcome and the key, never the address or the body.
    send_email = app_module.app.tasks[TASK_NAME]
    message = {"to": "dan@example.com", "subject": "Receipt", "html": "<p>Thanks</p>", "event_id": "order-9"}
    emails = [send_email.delay(**message)]
    emails[0].get(timeout=30)  # then the copy: two at once on two children may finish in either order
    emails.append(send_email.delay(**message))
    assert [o["status"] for o in results(emails)] == ["sent", "duplicate"]
    shown = flower.wait_state(emails[1].id, "SUCCESS")
    email_key = emails[1].get()["key"]
    assert "'status': 'duplicate'" in shown["result"] and email_key in shown["result"]
    assert shown["kwargs"] == f"<redacted: idempotency key {email_key}>"
    assert "dan@example.com" not in json.dumps([flower.task(e.id) for e in emails])
    assert fake_provider.delivery_count() == 1

    # Nothing personal in what the worker logged about it.
    log = worker.log().decode()
    # A routine duplicate is told by Celery's own "succeeded" line (its result is the outcome)...
    assert "succeeded in" in log and f"{{'status': 'duplicate', 'key': '{key}', 'message_id': 'msg-1'" in log
    assert f"status=duplicate task={send.name} key={key}" not in log  # ...our line for it is DEBUG
    assert "status=review" in log and "status=in_flight" in log
    assert ADDRESS not in log and "dan@example.com" not in log

    # The ledger down: fail closed, rescheduled with the outage as the retry's reason. README's row:
    # RETRY, again until the ledger is back; exception LedgerUnavailableError('Redis ledger unreachable: …');
    # result {'status': 'ledger_unavailable', 'reason': 'ledger_unavailable_error', 'reschedules': 1, …}.
    # Prefork, the default pool (a solo worker's task-retried event shows Retry(Retry(...), <exception>, <when>)).
    worker.stop()
    down = start_worker("-P", "prefork", "-c", "1", "-E", env={"IDEMMAIL_TEST_LEDGER": "redis://127.0.0.1:1/0"})
    waiting = send.delay(ADDRESS, 4)
    waiting_key = send.intent_key(ADDRESS, 4)
    seen: list[dict[str, Any]] = []

    def outage_shown(min_reschedules: int) -> dict[str, Any] | None:
        info = flower.task(waiting.id)
        if info is None:
            return None
        seen.append(info)
        if info.get("retried") is None or "'status': 'ledger_unavailable'" not in str(info.get("result")):
            return None
        return info if ast.literal_eval(info["result"])["reschedules"] >= min_reschedules else None

    first: dict[str, Any] = wait_for(lambda: outage_shown(1), timeout=30, interval=0.1)  # type: ignore[assignment]
    assert first["exception"].startswith("LedgerUnavailableError('Redis ledger unreachable: ")
    outage = ast.literal_eval(first["result"])  # from the task-idemmail event
    assert outage == {"status": "ledger_unavailable", "key": waiting_key, "message_id": None,
                      "reason": "ledger_unavailable_error", "reschedules": outage["reschedules"]}
    # Again until the ledger is back: the same task id is rescheduled, its count growing, never finished.
    later: dict[str, Any] = wait_for(  # type: ignore[assignment]
        lambda: outage_shown(outage["reschedules"] + 2), timeout=30, interval=0.1)
    assert later["retried"] > first["retried"]
    assert later["exception"].startswith("LedgerUnavailableError('Redis ledger unreachable: ")
    states = [i["state"] for i in seen]
    assert set(states) <= {"RECEIVED", "STARTED", "IDEMMAIL", "RETRY"}, states
    assert not any(d.startswith(f"{waiting_key}|") for d in sink.deliveries())  # fail closed: nothing sent
    down.stop()
    app_module.app.control.purge()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def metrics_worker(start_worker: Callable[..., Any], tmp_path: Path, *args: str,
                   **env: str) -> tuple[Any, int, Path]:
    """A prefork worker exporting /metrics from its multiprocess directory: (worker, port, directory)."""
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    port = free_port()
    worker = start_worker("-P", "prefork", *args, env={
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc), "IDEMMAIL_TEST_METRICS_PORT": str(port), **env})
    return worker, port, multiproc


def test_metrics_endpoint_sums_outcomes_across_prefork_children(
    app_module: Any, sink: Any, start_worker: Callable[..., Any], tmp_path: Path
) -> None:
    worker, port, multiproc = metrics_worker(start_worker, tmp_path, "-c", "2")
    send = app_module.send
    name = send.name

    sink.push_failure("ambiguous")
    results([send.delay("bob@example.com", 2)])  # parked for review

    # The first copy holds its claim until a copy has been counted in flight (then released).
    sink.control("hold_until_released", "1")
    copies = [send.delay(ADDRESS, 7)]
    wait_for(lambda: sink.r.llen(sink.k("holding")) >= 1, timeout=20)
    copies += [send.delay(ADDRESS, 7), send.delay(ADDRESS, 7)]
    in_flight = ("idemmail_outcomes_total", (("outcome", "in_flight"), ("task", name)))
    wait_for(lambda: scrape(port).get(in_flight, 0.0) >= 1, timeout=30, interval=0.2)
    sink.control("release", "1")
    out = results(copies)
    assert sorted(o["status"] for o in out) == ["duplicate", "duplicate", "sent"]
    key = out[0]["key"]

    # The same order key with another recipient is refused, and counted.
    strict = app_module.send_strict
    reused = results([strict.delay(ADDRESS, 8)]) + results([strict.delay("eve@example.com", 8)])
    assert type(reused[1]).__name__ == "IdempotencyKeyReuseError"

    def outcome(status: str, task: str = name) -> float:
        return metrics.get(("idemmail_outcomes_total", (("outcome", status), ("task", task))), 0.0)

    metrics = scrape(port)
    assert (outcome("sent"), outcome("duplicate"), outcome("review")) == (1, 2, 1)
    assert outcome("in_flight") >= 1
    assert (outcome("sent", strict.name), outcome("key_reuse", strict.name)) == (1, 1)
    assert metrics[("idemmail_inflight_collisions_total", (("task", name),))] == outcome("in_flight")
    assert metrics[("idemmail_ledger_operation_seconds_count", (("backend", "redis"), ("op", "claim")))] >= 4
    assert metrics[("idemmail_ledger_records", (("state", "review"),))] == 1
    assert metrics[("idemmail_ledger_up", ())] == 1
    # Summed from the pool children's files (however the pool spread the tasks), not the main process's memory.
    pids = {p.stem.rsplit("_", 1)[1] for p in multiproc.glob("counter_*.db")}
    assert pids and str(worker.proc.pid) not in pids

    log = worker.log().decode()
    assert f"{{'status': 'sent', 'key': '{key}'" in log  # Celery's "succeeded" line (ours for it is DEBUG)
    assert ADDRESS not in log and "bob@example.com" not in log and "eve@example.com" not in log
    assert "status=key_reuse" in log and "reason=to" in log


def test_a_reclaim_after_a_killed_pool_child_is_counted_once(
    app_module: Any, sink: Any, start_worker: Callable[..., Any], tmp_path: Path
) -> None:
    """A pool child SIGKILLed after its send: the redelivered copy reclaims the expired lease."""
    _, port, _ = metrics_worker(start_worker, tmp_path, "-c", "1", IDEMMAIL_TEST_LEASE="2")
    task = app_module.send_keyed
    sink.control("die_after_send", "1")
    [out] = results([task.delay("eve@example.com", 11)])
    assert out["status"] == "sent"  # resent with the same key after the reclaim
    metrics = scrape(port)
    assert metrics[("idemmail_reclaims_total", (("task", task.name),))] == 1
    assert metrics[("idemmail_outcomes_total", (("outcome", "sent"), ("task", task.name)))] == 1
    assert ("idemmail_outcomes_total", (("outcome", "reclaimed"), ("task", task.name))) not in metrics  # a step
    assert len(sink.deliveries()) == 1


def test_a_missing_multiprocess_dir_leaves_metrics_off_and_sends_exactly_once(
    app_module: Any, sink: Any, start_worker: Callable[..., Any], tmp_path: Path
) -> None:
    worker = start_worker("-P", "prefork", "-c", "2", env={
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing"), "IDEMMAIL_TEST_METRICS_PORT": str(free_port())})
    send = app_module.send
    out = results([send.delay(ADDRESS, 11)])
    out += results([send.delay(ADDRESS, 11)])
    assert [o["status"] for o in out] == ["sent", "duplicate"], out
    assert len(sink.deliveries()) == 1
    log = worker.log().decode()
    assert "does not exist or is not a directory; metrics are OFF" in log  # before logging is set up: no level
