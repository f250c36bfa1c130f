"""The project's own checks fail when they should: each judge is shown a planted failure.

The chaos verdict (:func:`chaos.scenario.verdict`) is fed recorded outcomes, most of them read from the
real fake provider, SMTP sink and Redis ledger; ``python -m chaos.run`` is run as a user runs it; the
suite's rule for a missing service or program is called as a test meets it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from chaos.scenario import (
    DEDUPED_PER_FAULT,
    HTTP_FAULTS,
    HTTPFake,
    LedgerView,
    Result,
    Scenario,
    SMTPFake,
    fault_kinds,
    verdict,
)
from idemmail_celery.email import EmailMessage
from idemmail_celery.errors import AmbiguousSendError, TransientSendError
from idemmail_celery.ledger import ClaimRequest
from idemmail_celery.providers import from_url
from idemmail_celery.providers.http import HTTPProvider

from .conftest import REDIS_URL, require_program, service_missing, unique

ROOT = Path(__file__).resolve().parents[1]


def key_of(i: int) -> str:
    return hashlib.sha256(f"{uuid.uuid4()}-{i}".encode()).hexdigest()


def message(i: int) -> EmailMessage:
    return EmailMessage.build(sender="shop@example.com", to=f"user{i}@example.com", subject=f"Receipt {i}",
                              text=f"order {i}")


def clean_run(s: Scenario) -> Result:
    """What a run of ``s`` that went as planned and delivered every intent once measures."""
    kinds = fault_kinds(s) if s.fault_rate > 0 else ()
    return Result(scenario=s, ns="t", log_dir="-", intents=s.intents, messages=s.intents * s.copies,
                  deliveries=s.intents, states={"sent": s.intents}, child_kills=s.kills, ledger_blips=s.ledger_blips,
                  rotated=s.rotate_secret_at is not None, faults=len(kinds), faults_by_kind=dict.fromkeys(kinds, 1))


@pytest.fixture
def keyed() -> Iterator[HTTPFake]:
    provider = HTTPFake(dedupe=True, slow_seconds=1.0, max_records=1000)
    provider.start()
    yield provider
    provider.stop()


def judged(provider: HTTPFake, s: Scenario) -> Result:
    """A clean run of ``s``, with what ``provider`` recorded in place of the made-up deliveries."""
    r = clean_run(s)
    delivered = provider.deliveries_by_key()
    r.deliveries = sum(delivered.values())
    r.duplicates = sum(n - 1 for n in delivered.values() if n > 1)
    r.deduped, r.deduped_unexplained, r.ambiguous_faults = provider.deduped()
    return r


# -- the chaos verdict --


def test_verdict_fails_a_keyed_run_where_every_copy_reached_the_provider(keyed: HTTPFake) -> None:
    s = Scenario(name="every-copy", intents=30, copies=3, kills=4, fault_rate=0.0)
    sender = HTTPProvider(keyed.url, api_key=keyed.api_key, timeout=5.0)
    keys = [key_of(i) for i in range(s.intents)]
    try:
        for i, key in enumerate(keys):  # the library under judgement: one send per intent
            sender.send(message(i), key=key)
        assert verdict(judged(keyed, s)) == []
        for i, key in enumerate(keys):  # ... and then every other copy too, under the same key
            for _ in range(s.copies - 1):
                sender.send(message(i), key=key)
    finally:
        sender.close()
    r = judged(keyed, s)
    # On deliveries alone this run is perfect: the provider's de-duplication hid every extra copy.
    assert (r.deliveries, r.duplicates, r.deduped) == (s.intents, 0, 60)
    assert any("de-duplicated under keys no ambiguous fault hit" in p for p in verdict(r)), verdict(r)


def test_verdict_bounds_the_copies_one_ambiguous_fault_explains(keyed: HTTPFake) -> None:
    s = Scenario(name="one-fault", intents=1, copies=3, kills=0, fault_rate=0.0)
    sender = HTTPProvider(keyed.url, api_key=keyed.api_key, timeout=5.0)
    key = key_of(0)
    try:
        keyed.queue_fault("drop_after_accept")
        with pytest.raises(AmbiguousSendError):
            sender.send(message(0), key=key)
        sender.send(message(0), key=key)  # the resend the fault calls for: explained
        assert verdict(judged(keyed, s)) == []
        for _ in range(DEDUPED_PER_FAULT):  # more resends than one fault explains
            sender.send(message(0), key=key)
    finally:
        sender.close()
    r = judged(keyed, s)
    assert (r.deliveries, r.ambiguous_faults, r.deduped_unexplained) == (1, 1, 0)
    assert any(f"at most {DEDUPED_PER_FAULT} each" in p for p in verdict(r)), verdict(r)


def test_verdict_fails_a_run_whose_planned_disturbances_did_not_happen() -> None:
    s = Scenario(name="planned", intents=100, kills=6, fault_rate=0.05, ledger_blips=3, rotate_secret_at=0.25)
    assert verdict(clean_run(s)) == []
    cases: dict[str, dict[str, Any]] = {
        "0 of the 6 planned kills happened": {"child_kills": 0},
        "5 of the 6 planned kills happened": {"child_kills": 3, "worker_kills": 2},
        "planned faults never applied: slow": {"faults": 45,
                                                "faults_by_kind": {k: 15 for k in HTTP_FAULTS if k != "slow"}},
        "planned faults never applied: none at all": {"faults": 0, "faults_by_kind": {}},
        "1 of the 3 planned ledger outages happened": {"ledger_blips": 1},
        "the key secret was never rotated": {"rotated": False},
    }
    for expected, planted in cases.items():
        problems = verdict(replace(clean_run(s), **planted))
        assert any(expected in p for p in problems), (expected, problems)


def drill(s_keyed: bool) -> Result:
    s = Scenario(name="drill", provider="http" if s_keyed else "http-keyless", intents=100, kills=0,
                 fault_rate=0.0, flush_ledger_at=0.5)
    return replace(clean_run(s), records_flushed=50, delivered_at_flush=50, acknowledged=True)


def test_verdict_fails_a_drill_whose_flush_lost_less_than_was_delivered() -> None:
    assert verdict(drill(True)) == []
    # What the drill reported when it counted record keys only: the sent records are entries on shelves.
    problems = verdict(replace(drill(True), records_flushed=1, delivered_at_flush=833))
    assert "the flush deleted 1 records when 833 intents had been delivered" in problems


def test_verdict_fails_a_keyed_drill_that_leaves_intents_undelivered() -> None:
    r = replace(drill(True), deliveries=95, missing=5, states={"sent": 95, "review": 5}, reviews=5)
    assert "5 intents never delivered" in verdict(r)
    lost = replace(r, states={"sent": 95, "none": 5}, reviews=0, no_record=5, undelivered_not_review=5)
    assert "5 intents neither delivered nor in review (silently lost)" in verdict(lost)


def test_chaos_run_with_only_naming_no_scenario_exits_non_zero(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "chaos.run", "--only", ",", "--no-write", "--log-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "names no scenario" in done.stderr


# -- the fakes' own counts --


def test_smtp_faults_count_only_those_applied() -> None:
    provider = SMTPFake()
    provider.start()
    try:
        provider.queue_fault("tempfail_data_command")
        assert provider.applied_faults() == []  # queued, and nothing has met it yet
        smtp = from_url(provider.url, timeout=5)
        with pytest.raises(TransientSendError):
            smtp.send(message(1), key=key_of(1))
        provider.queue_fault("drop_after_data")
        with pytest.raises(AmbiguousSendError):
            smtp.send(message(2), key=key_of(2))
        provider.queue_fault("stall_after_data")  # never met: stays out of the count
        applied = provider.applied_faults()
        assert [f["kind"] for f in applied] == ["tempfail_data_command", "drop_after_data"]
        assert applied[0]["key"] is None and applied[1]["key"] in provider.deliveries_by_key()
        assert provider.sink.faults_left() == 1
    finally:
        provider.stop()


def test_drill_flush_counts_sent_records_on_their_shelves_too() -> None:
    try:
        view = LedgerView(REDIS_URL, {"prefix": unique("flush"), "retention_seconds": 3600.0})
    except Exception as exc:
        service_missing("redis", exc)
    try:
        for i in range(43):
            claim = view.ledger.claim(ClaimRequest(key=key_of(i), task_name="t.send", payload="{}",
                                                   fingerprint="f" * 64))
            if i < 40:  # sent: an entry on its shelf; the other 3 stay claimed, a key each
                view.ledger.complete(claim.record.key, claim.token, {"message_id": str(uuid.uuid4())})
        assert view.flush() == 43
    finally:
        view.drop()


# -- the suite's rule for what it needs --


def test_a_missing_service_fails_the_test_unless_skips_are_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("IDEMMAIL_TEST_ALLOW_SKIPS", raising=False)
    with pytest.raises(BaseException) as caught:  # a skip is the failure this looks for
        service_missing("redis", ConnectionError("refused"))
    assert caught.type is pytest.fail.Exception, caught.type
    monkeypatch.setenv("IDEMMAIL_TEST_ALLOW_SKIPS", "1")
    with pytest.raises(pytest.skip.Exception):
        service_missing("redis", ConnectionError("refused"))
    monkeypatch.setenv("CI", "true")  # CI has everything: the opt-out does not apply there
    with pytest.raises(pytest.fail.Exception):
        service_missing("redis", ConnectionError("refused"))


def test_a_missing_program_fails_the_test(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("IDEMMAIL_TEST_ALLOW_SKIPS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no openssl here
    with pytest.raises(BaseException) as caught:  # a skip is the failure this looks for
        require_program("openssl")
    assert caught.type is pytest.fail.Exception, caught.type


@pytest.mark.worker  # a pytest run in another interpreter
def test_make_test_fails_when_a_service_is_unreachable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "IDEMMAIL_TEST_ALLOW_SKIPS")}
    env["IDEMMAIL_TEST_REDIS"] = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         "tests/test_judges.py::test_drill_flush_counts_sent_records_on_their_shelves_too"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout
    assert "redis unreachable" in done.stdout and "1 failed" in done.stdout, done.stdout
