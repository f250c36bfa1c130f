"""What a run reports on its rarer paths (log level, fields, metrics), in one process.

Unit tests of the reports: each runs the task with Celery's ``Task.apply()`` (the state machine
in this process, against a real SQLite ledger, no broker on purpose) so that a ledger failure
can be injected. What a real worker reports is proved in ``tests/integration/test_monitoring.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry

from idemmail_celery import AmbiguousSendError, IdempotentTask, LedgerUnavailableError, PermanentSendError, metrics
from idemmail_celery import handler as handler_mod
from idemmail_celery.errors import RecordNotFoundError, StaleTokenError
from idemmail_celery.outcomes import _logfmt, clean_reason

from .conftest import unique


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> CollectorRegistry:
    reg = CollectorRegistry()
    monkeypatch.setattr(metrics, "active", metrics.Metrics(reg))
    monkeypatch.setattr(metrics, "_broken", False)
    return reg


@pytest.fixture
def app(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Iterator[Celery]:
    caplog.set_level(logging.INFO, logger="idemmail_celery.outcome")
    a = Celery(unique("reports"), broker="memory://", set_as_current=False)
    a.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'l.sqlite3'}",
                  idemmail_key_secret="s", idemmail_retry_backoff=0.01)
    yield a


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "idemmail_celery.outcome"]


def unrecorded(reg: CollectorRegistry, task: str, outcome: str, reason: str) -> float | None:
    return reg.get_sample_value("idemmail_unrecorded_total", {"task": task, "outcome": outcome, "reason": reason})


def test_fail_open_is_reported_as_its_own_outcome(app: Celery, registry: CollectorRegistry,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    @app.task(shared=False, base=IdempotentTask, name=unique("fo"), idempotency_ledger_url="redis://127.0.0.1:1/0",
              idempotency_fail_open=True)
    def send(to: str) -> dict[str, Any]:
        return {"message_id": "m-1"}

    assert send.apply(("a@example.com",)).get() == {"message_id": "m-1"}
    [(level, line)] = lines(caplog)
    assert level == "WARNING" and "status=fail_open" in line and "message_id=m-1" in line
    assert "reason=ledger_unavailable_error recorded=false" in line
    assert registry.get_sample_value("idemmail_outcomes_total", {"task": send.name, "outcome": "fail_open"}) == 1
    assert unrecorded(registry, send.name, "fail_open", "ledger_unavailable_error") == 1


def test_the_outage_budget_running_out_is_reported_before_the_intent_is_dropped(
        app: Celery, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    app.conf.idemmail_outage_max_retries = 0

    @app.task(shared=False, base=IdempotentTask, name=unique("gu"), idempotency_ledger_url="redis://127.0.0.1:1/0")
    def send(to: str) -> None: ...

    with pytest.raises(LedgerUnavailableError):
        send.apply(("a@example.com",)).get()
    [(level, line)] = lines(caplog)
    assert level == "ERROR" and "status=ledger_unavailable_gave_up" in line and "reschedules=0" in line
    assert registry.get_sample_value(
        "idemmail_outcomes_total", {"task": send.name, "outcome": "ledger_unavailable_gave_up"}) == 1


def test_a_send_after_losing_the_lease_is_told_apart(
        app: Celery, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    @app.task(shared=False, base=IdempotentTask, name=unique("ls"))
    def send(to: str) -> dict[str, Any]:
        return {"message_id": "m-2"}

    def complete(*_: Any, **__: Any) -> None:
        raise StaleTokenError("lease taken over")

    monkeypatch.setattr(send.ledger, "complete", complete)
    assert send.apply(("a@example.com",)).get()["status"] == "sent"
    [(level, line)] = lines(caplog)
    assert level == "ERROR" and "status=sent" in line and "reason=lease_lost recorded=false" in line
    assert unrecorded(registry, send.name, "sent", "lease_lost") == 1
    assert registry.get_sample_value("idemmail_outcomes_total", {"task": send.name, "outcome": "sent"}) == 1


def test_a_send_the_ledger_cannot_record_yet_travels_with_a_reschedule(
        app: Celery, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sent, and the ledger is down: said loudly, and the verdict goes with the next delivery (not acked as done)."""
    @app.task(shared=False, base=IdempotentTask, name=unique("lu"))
    def send(to: str) -> dict[str, Any]:
        return {"message_id": "m-3"}

    def complete(*_: Any, **__: Any) -> None:
        raise LedgerUnavailableError("down")

    monkeypatch.setattr(send.ledger, "complete", complete)
    monkeypatch.setattr(handler_mod.time, "sleep", lambda s: None)
    result = send.apply(("a@example.com",))
    assert result.state == "RETRY"
    (level, line), (_, then) = lines(caplog)
    assert level == "ERROR" and "status=sent" in line and "reason=unrecorded recorded=false" in line
    assert "status=ledger_unavailable" in then and "reschedules=1" in then
    assert unrecorded(registry, send.name, "sent", "unrecorded") == 1


def test_a_verdict_the_ledger_refused_says_recorded_false(
        app: Celery, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    @app.task(shared=False, base=IdempotentTask, name=unique("vr"))
    def send(to: str) -> None:
        raise PermanentSendError("mailbox unavailable", reason="rejected")

    def fail(*_: Any, **__: Any) -> None:  # a refusal that is not a takeover (that one waits for the record)
        raise RecordNotFoundError("no ledger record")

    monkeypatch.setattr(send.ledger, "fail", fail)
    with pytest.raises(PermanentSendError):
        send.apply(("a@example.com",)).get()
    [(level, line)] = lines(caplog)
    assert level == "WARNING" and "status=failed" in line
    assert "reason=rejected recorded=false error=record_not_found_error" in line


def test_a_reconciled_send_is_one_outcome_with_reason_reconciled(
        app: Celery, registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    class Reconciling(IdempotentTask):  # type: ignore[misc]
        abstract = True

        def reconcile(self, key: str, payload: Any) -> Any:
            return {"message_id": "found-1"}

    @app.task(shared=False, base=Reconciling, name=unique("rc"), max_retries=0)
    def send(to: str) -> None:
        raise AmbiguousSendError("read timeout", reason="timeout")

    assert send.apply(("a@example.com",)).get()["message_id"] == "found-1"
    [(level, line)] = lines(caplog)
    assert level == "INFO" and "status=sent" in line and "reason=reconciled" in line


@pytest.mark.parametrize(("value", "shown"), [
    ("x\nidemmail outcome status=sent", '"x\\nidemmail outcome status=sent"'),
    ("a\rb", '"a\\rb"'), ("tab\there", '"tab\\there"'), ("back\\slash", '"back\\\\slash"'), ("\x1b[2J", '"\\x1b[2J"'),
])
def test_log_values_never_span_lines(value: str, shown: str) -> None:
    assert _logfmt(value) == shown
    assert "\n" not in _logfmt(value)


@pytest.mark.parametrize(("reason", "kept"), [
    ("timeout", "timeout"), ("to,order_id", "to,order_id"), ("smtp_550", "smtp_550"),
    ("bob@example.com", "other"), ("x\ny", "other"), ("Timeout", "other"), ("a" * 41, "other"), ("", "other"),
])
def test_reasons_are_short_words(reason: str, kept: str) -> None:
    assert clean_reason(reason) == kept


def test_a_forged_reason_does_not_reach_the_log(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)

    @app.task(shared=False, base=IdempotentTask, name=unique("fr"))
    def send(to: str) -> None:
        raise PermanentSendError("no", reason="x\nidemmail outcome status=sent key=forged")

    with pytest.raises(PermanentSendError):
        send.apply(("a@example.com",)).get()
    [(_, line)] = lines(caplog)
    assert "reason=other" in line and "forged" not in line


class _FakeDispatcher:
    def __init__(self, made: list[_FakeDispatcher], sent: list[tuple[str, dict[str, Any]]]) -> None:
        made.append(self)
        self.sent = sent

    def send(self, type_: str, **fields: Any) -> None:
        self.sent.append((type_, fields))


def test_events_only_for_outcomes_that_end_in_failure_or_retry_on_one_dispatcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from idemmail_celery import outcomes

    made: list[_FakeDispatcher] = []
    sent: list[tuple[str, dict[str, Any]]] = []
    app = SimpleNamespace(events=SimpleNamespace(Dispatcher=lambda *a, **k: _FakeDispatcher(made, sent)),
                          connection_for_write=lambda: None)
    task = SimpleNamespace(name="t", app=app, request=SimpleNamespace(id="id-1", retries=0, hostname="w@h"))
    monkeypatch.setattr(outcomes._Worker, "task_events", True)
    monkeypatch.setattr(outcomes._Events, "dispatcher", None)
    for status in ("sent", "duplicate", "reclaimed", "review", "retry", "in_flight"):
        outcomes.report(task, status, "k")
    outcomes.report(task, "duplicate", "k", recorded="failed")  # a replayed failure ends in FAILURE
    outcomes.report(task, "sent", "k", reason="lease_lost", recorded="false")
    assert [f["status"] for _, f in sent] == ["review", "retry", "in_flight", "duplicate", "sent"]
    assert sent[-1][1]["recorded"] is False and "'recorded': False" in sent[-1][1]["result"]  # a flag, not "false"
    assert len(made) == 1  # one dispatcher for all of them
    outcomes._Events.after_fork()  # a forked child builds its own
    outcomes.report(task, "failed", "k")
    assert len(made) == 2


def test_routine_successes_log_at_debug_and_everything_else_above_it(caplog: pytest.LogCaptureFixture) -> None:
    """Celery's "succeeded" line already shows a routine send or replay (the result is the outcome)."""
    from types import SimpleNamespace

    from idemmail_celery import outcomes

    caplog.set_level(logging.DEBUG, logger="idemmail_celery.outcome")
    task = SimpleNamespace(name="t", request=SimpleNamespace(id="id-1", retries=0, hostname=None))
    outcomes.report(task, "sent", "k", message_id="m")
    outcomes.report(task, "duplicate", "k", message_id="m", recorded="sent")
    outcomes.report(task, "sent", "k", message_id="m", reason="reconciled")
    outcomes.report(task, "sent", "k", message_id="m", event=False, bulk=True)  # a campaign's recipient
    outcomes.report(task, "duplicate", "k", recorded="review", reason="timeout")
    outcomes.report(task, "sent", "k", reason="unrecorded", recorded="false")
    outcomes.report(task, "failed", "k", reason="invalid_email", recorded=False)
    assert [level for level, _ in lines(caplog)] == ["DEBUG", "DEBUG", "INFO", "INFO", "INFO", "ERROR", "WARNING"]
    records = [r for r in caplog.records if r.name == "idemmail_celery.outcome"]
    assert [r.idemmail["recorded"] for r in records[-2:]] == [False, False]  # type: ignore[attr-defined]
    assert lines(caplog)[-1][1].endswith("reason=invalid_email recorded=false")


def test_a_passed_retry_deadline_logs_at_error_and_every_failure_counts_by_reason(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    from types import SimpleNamespace

    from idemmail_celery import outcomes

    caplog.set_level(logging.INFO, logger="idemmail_celery.outcome")
    task = SimpleNamespace(name="t", request=SimpleNamespace(id="id-1", retries=41, hostname=None))
    outcomes.report(task, "failed", "k", reason="retry_deadline")  # the provider refused it for hours
    outcomes.report(task, "failed", "k", reason="rejected")
    assert [level for level, _ in lines(caplog)] == ["ERROR", "WARNING"]
    failed = {r: registry.get_sample_value("idemmail_failed_total", {"task": "t", "reason": r})
              for r in ("retry_deadline", "rejected")}
    assert failed == {"retry_deadline": 1.0, "rejected": 1.0}
