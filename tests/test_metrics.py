"""Metrics and outcome log lines in one process (the worker-level proof is tests/integration/test_monitoring.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from idemmail_celery.errors import StaleTokenError
from idemmail_celery.ledger import ClaimRequest, Ledger, from_url
from idemmail_celery.ledger.metered import MeteredLedger
from idemmail_celery.metrics import Metrics, RecordsCollector
from idemmail_celery.outcomes import _logfmt


@pytest.fixture
def sqlite_ledger(tmp_path: Path) -> Ledger:
    return from_url(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")


def claim(ledger: Ledger, key: str) -> int:
    return ledger.claim(ClaimRequest(key=key, task_name="t", payload='{"args":[],"kwargs":{}}',
                                     fingerprint="f")).token


def test_metrics_off_imports_no_prometheus_client_and_leaves_ledgers_untouched() -> None:
    code = (
        "import sys, idemmail_celery\n"
        "from idemmail_celery import metrics, task\n"
        "ledger = task.get_ledger('sqlite:///:memory:')\n"
        "assert metrics.active is None and 'claim' not in vars(ledger)\n"
        "assert 'prometheus_client' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_metered_ledger_times_every_operation_and_counts_errors(sqlite_ledger: Ledger,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from idemmail_celery import metrics

    registry = CollectorRegistry()
    monkeypatch.setattr(metrics, "active", Metrics(registry))
    metered = MeteredLedger(sqlite_ledger)
    token = claim(metered, "k1")
    metered.complete("k1", token, {"value": None, "message_id": "m"})
    with pytest.raises(StaleTokenError):
        metered.fail("k1", token, {"reason": "x"})

    def count(op: str) -> float | None:
        return registry.get_sample_value("idemmail_ledger_operation_seconds_count", {"op": op, "backend": "sql"})

    assert (count("claim"), count("complete"), count("fail")) == (1, 1, 1)
    assert registry.get_sample_value(
        "idemmail_ledger_errors_total", {"op": "fail", "backend": "sql", "error": "StaleTokenError"}) == 1
    monkeypatch.setattr(metrics, "active", None)  # off: nothing counted, the call still goes through
    claim(metered, "k2")
    assert count("claim") == 1


def test_outcomes_count_in_flight_and_reclaims_separately() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    for status in ("sent", "duplicate", "duplicate", "in_flight"):
        m.outcome("t", status)
    m.reclaimed("t")  # a step of a run, not its outcome
    value = registry.get_sample_value
    assert value("idemmail_outcomes_total", {"task": "t", "outcome": "reclaimed"}) is None
    assert value("idemmail_outcomes_total", {"task": "t", "outcome": "duplicate"}) == 2
    assert value("idemmail_inflight_collisions_total", {"task": "t"}) == 1
    assert value("idemmail_reclaims_total", {"task": "t"}) == 1


def test_records_gauge_counts_review_at_most_once_per_ttl(sqlite_ledger: Ledger) -> None:
    registry = CollectorRegistry()
    collector = RecordsCollector(lambda: sqlite_ledger, ttl=3600)
    registry.register(collector)
    sqlite_ledger.park("a", claim(sqlite_ledger, "a"), {"reason": "timeout"})
    claim(sqlite_ledger, "b")
    assert registry.get_sample_value("idemmail_ledger_records", {"state": "review"}) == 1
    assert registry.get_sample_value("idemmail_ledger_records", {"state": "claimed"}) == 1
    sqlite_ledger.park("b", 1, {"reason": "timeout"})
    assert registry.get_sample_value("idemmail_ledger_records", {"state": "review"}) == 1  # cached
    collector.ttl = 0
    assert registry.get_sample_value("idemmail_ledger_records", {"state": "review"}) == 2
    assert registry.get_sample_value("idemmail_ledger_up") == 1


def test_records_gauge_reports_an_unreadable_ledger_as_down() -> None:
    registry = CollectorRegistry()
    registry.register(RecordsCollector(lambda: from_url("redis://127.0.0.1:1/0")))
    assert registry.get_sample_value("idemmail_ledger_up") == 0
    assert registry.get_sample_value("idemmail_ledger_records", {"state": "review"}) is None


@pytest.mark.parametrize(("value", "shown"), [
    (None, "-"), ("msg-1", "msg-1"), ("a b", '"a b"'), ('say "x"', '"say \\"x\\""'), ("", '""'), (3, "3"),
])
def test_log_values_are_logfmt(value: object, shown: str) -> None:
    assert _logfmt(value) == shown


MISSING_DIR_RUN = """
import logging, sys
logging.basicConfig(level=logging.INFO)
from idemmail_celery import metrics, task
from idemmail_celery.ledger import ClaimRequest
metrics.enable()
ledger = task.get_ledger("sqlite:///" + sys.argv[1])
claim = ledger.claim(ClaimRequest(key="k", task_name="t", payload='{"args":[],"kwargs":{}}', fingerprint="f"))
ledger.complete("k", claim.token, {"value": None, "message_id": "m"})  # its result is not replaced
assert ledger.get("k").state.value == "sent", ledger.get("k")
assert metrics.active is None  # off in this process from the first failure on
print("SENT-ONCE")
"""


def test_a_missing_multiprocess_dir_turns_metrics_off_and_never_stops_a_ledger_call(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "missing")}
    done = subprocess.run([sys.executable, "-c", MISSING_DIR_RUN, str(tmp_path / "l.sqlite3")], env=env,
                          cwd=Path(__file__).parents[1], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "SENT-ONCE" in done.stdout
    assert "ERROR:idemmail_celery:idemmail metrics: prometheus_client failed (FileNotFoundError" in done.stderr
    assert done.stderr.count("metrics are OFF") == 1  # said once, not per call


def test_a_failing_observe_does_not_replace_the_ledger_result(sqlite_ledger: Ledger,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import Histogram

    from idemmail_celery import metrics

    def fail(self: object, amount: float, exemplar: object = None) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(Histogram, "observe", fail)
    monkeypatch.setattr(metrics, "_broken", False)
    m = Metrics(CollectorRegistry())
    monkeypatch.setattr(metrics, "active", m)
    sqlite_ledger = MeteredLedger(sqlite_ledger)
    token = claim(sqlite_ledger, "k1")
    sqlite_ledger.complete("k1", token, {"value": None, "message_id": "m"})
    assert sqlite_ledger.get("k1").state.value == "sent"  # type: ignore[union-attr]
    assert metrics.active is None


@pytest.mark.parametrize("where", ["missing", "file", "/proc"])
def test_worker_start_refuses_a_bad_multiprocess_dir_with_an_error(
    tmp_path: Path, where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from types import SimpleNamespace

    from idemmail_celery import metrics, outcomes

    path = {"missing": str(tmp_path / "missing"), "file": str(tmp_path / "f"), "/proc": "/proc"}[where]
    (tmp_path / "f").write_text("")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", path)
    monkeypatch.setattr(metrics, "active", None)
    enabled: list[bool] = []
    monkeypatch.setattr(metrics, "enable", lambda: enabled.append(True))
    app = SimpleNamespace(conf={"idemmail_metrics": True})
    outcomes.configure_metrics(app, SimpleNamespace(pool_cls="celery.concurrency.prefork:TaskPool"))
    assert enabled == []
    assert any(r.levelname == "ERROR" and "metrics are OFF" in r.getMessage() for r in caplog.records)


def test_worker_start_warns_of_stale_files_in_the_multiprocess_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from types import SimpleNamespace

    from idemmail_celery import metrics, outcomes

    (tmp_path / "counter_123.db").write_bytes(b"")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    enabled: list[bool] = []
    monkeypatch.setattr(metrics, "enable", lambda: enabled.append(True))
    outcomes.configure_metrics(SimpleNamespace(conf={"idemmail_metrics": True}), SimpleNamespace(pool_cls="solo"))
    assert enabled == [True]
    assert any(r.levelname == "WARNING" and "already holds 1 .db files" in r.getMessage() for r in caplog.records)


def test_metrics_without_a_port_on_prefork_without_a_multiprocess_dir_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from types import SimpleNamespace

    from idemmail_celery import metrics, outcomes

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setattr(metrics, "enable", lambda: None)
    outcomes.configure_metrics(SimpleNamespace(conf={"idemmail_metrics": "true"}),
                             SimpleNamespace(pool_cls="<class 'celery.concurrency.prefork.TaskPool'>"))
    assert any("PROMETHEUS_MULTIPROC_DIR" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_a_sealed_ledger_is_labelled_by_its_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cryptography.fernet import Fernet

    from idemmail_celery import metrics

    registry = CollectorRegistry()
    ledger = from_url(f"sqlite:///{tmp_path / 's.sqlite3'}", payload_keys=[Fernet.generate_key().decode()])
    assert type(ledger).__name__ == "SealedLedger"
    monkeypatch.setattr(metrics, "active", Metrics(registry))
    claim(MeteredLedger(ledger), "k")
    assert registry.get_sample_value("idemmail_ledger_operation_seconds_count", {"op": "claim", "backend": "sql"}) == 1


def test_the_records_gauge_opens_the_ledger_with_the_tasks_options(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from cryptography.fernet import Fernet

    from idemmail_celery import outcomes as outcomes_mod

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(outcomes_mod, "shared", lambda url, options: seen.append(options) or object())
    key = Fernet.generate_key().decode()
    conf = {"idemmail_ledger_url": "redis://127.0.0.1:6379/0", "idemmail_payload_keys": [key],
            "idemmail_keep_payload": True, "idemmail_ledger_options": {"prefix": "shop"}}
    outcomes_mod.app_ledger(SimpleNamespace(conf=conf))()
    [options] = seen
    assert options["payload_keys"] == [key] and options["keep_payload"] is True
    assert options["prefix"] == "shop" and options["passive"] is True
