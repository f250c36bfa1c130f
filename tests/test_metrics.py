"""Metrics and outcome log lines in one process (the worker-level proof is tests/integration/test_monitoring.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from idemmail_celery import StaleTokenError, from_url
from idemmail_celery.ledger import ClaimRequest, Ledger
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


def test_instrumented_ledger_times_every_operation_and_counts_errors(sqlite_ledger: Ledger) -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    assert m.instrument(sqlite_ledger) is sqlite_ledger
    m.instrument(sqlite_ledger)  # once only
    token = claim(sqlite_ledger, "k1")
    sqlite_ledger.complete("k1", token, {"value": None, "message_id": "m"})
    with pytest.raises(StaleTokenError):
        sqlite_ledger.fail("k1", token, {"reason": "x"})

    def count(op: str) -> float | None:
        return registry.get_sample_value("idemmail_ledger_operation_seconds_count", {"op": op, "backend": "sql"})

    assert (count("claim"), count("complete"), count("fail")) == (1, 1, 1)
    assert registry.get_sample_value(
        "idemmail_ledger_errors_total", {"op": "fail", "backend": "sql", "error": "StaleTokenError"}) == 1
    assert sqlite_ledger.complete.__name__ == "complete"  # task.py logs moves by name


def test_outcomes_count_in_flight_and_reclaims_separately() -> None:
    registry = CollectorRegistry()
    m = Metrics(registry)
    for status in ("sent", "duplicate", "duplicate", "in_flight", "reclaimed"):
        m.outcome("t", status)
    value = registry.get_sample_value
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
