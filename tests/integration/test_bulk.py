"""Bulk sends: batched claims, and a campaign retried after a crash half-way sends to everyone once."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from typing import Any

import pytest

from idemmail_celery.bulk import CAMPAIGN_TASK
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import FakeProvider

from ..conftest import wait_for
from .conftest import results


@pytest.fixture
def app_for_fake(worker_env: dict[str, str], request: pytest.FixtureRequest) -> Any:
    worker_env.update(IDEMMAIL_TEST_LEASE="2")
    return request.getfixturevalue("fake_app")


def pool_children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


def test_campaign_sends_each_recipient_once_and_matches_single_sends(
    app_for_fake: Any, fake: FakeProvider, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "2")
    app = app_for_fake.app
    recipients = [f"user{i}@example.com" for i in range(50)]
    single = app.tasks[TASK_NAME].delay(to="user7@example.com", subject="Nov", text="news", event_id="nov-news")
    assert results([single])[0]["status"] == "sent"
    out = results([app.tasks[CAMPAIGN_TASK].delay(
        campaign_id="nov-news", recipients=recipients + recipients[:5], subject="Nov", text="news", batch_size=20,
    )])[0]
    assert out["total"] == 50 and out["sent"] == 49 and out["duplicate"] == 1  # user7 already had it
    assert fake.delivery_count() == 50
    assert sorted(d.recipients[0] for d in fake.deliveries()) == sorted(recipients)


def test_campaign_retried_after_crash_half_way_reaches_everyone_once(
    app_for_fake: Any, fake: FakeProvider, start_worker: Any
) -> None:
    worker = start_worker("-P", "prefork", "-c", "1")
    app = app_for_fake.app
    n = 1000
    recipients = [f"r{i}@example.com" for i in range(n)]
    ar = app.tasks[CAMPAIGN_TASK].delay(campaign_id="black-friday", recipients=recipients, subject="Sale",
                                        html="<p>50% off</p>", batch_size=100)
    wait_for(lambda: fake.delivery_count() >= n // 2, timeout=120, interval=0.01)
    for child in pool_children(worker.proc.pid):  # the campaign dies mid-batch; acks_late redelivers it
        os.kill(child, signal.SIGKILL)
    wait_for(lambda: b"exited with 'signal 9" in worker.log(), timeout=30)
    out = ar.get(timeout=180)
    assert out["total"] == n
    per_recipient = Counter(d.recipients[0] for d in fake.deliveries())
    assert len(per_recipient) == n  # everyone got it
    assert max(per_recipient.values()) == 1  # nobody twice
    # The ledger did the work, not the provider's de-duplication: at most the batch in flight
    # at the crash went to the provider a second time (with the same keys).
    assert fake.attempt_count() <= n + 100, fake.attempt_count()
    print(f"bulk crash run: {fake.attempt_count()} provider requests for {n} recipients, "
          f"{fake.duplicates_suppressed()} suppressed by the provider")
    ledger = app.tasks[TASK_NAME].ledger
    states = Counter(r.state.value for r in ledger.iter_records())
    assert states == {"sent": n}


def test_campaign_reports_each_recipient_outcome_without_addresses(
    app_for_fake: Any, fake: FakeProvider, start_worker: Any
) -> None:
    from .test_monitoring import free_port, scrape

    port = free_port()
    worker = start_worker("-P", "solo", env={"IDEMMAIL_TEST_METRICS_PORT": str(port)})
    app = app_for_fake.app
    recipients = [f"user{i}@example.com" for i in range(12)]
    assert results([app.tasks[TASK_NAME].delay(to="user3@example.com", subject="Dec", text="news",
                                               event_id="dec-news")])[0]["status"] == "sent"
    out = results([app.tasks[CAMPAIGN_TASK].delay(campaign_id="dec-news", recipients=recipients, subject="Dec",
                                                  text="news", batch_size=5)])[0]
    assert (out["sent"], out["duplicate"]) == (11, 1)
    metrics = scrape(port)

    def outcome(status: str) -> float:
        return metrics.get(("idemmail_outcomes_total", (("outcome", status), ("task", CAMPAIGN_TASK))), 0.0)

    assert (outcome("sent"), outcome("duplicate")) == (11, 1)
    log = worker.log().decode()
    assert log.count(f"status=sent task={CAMPAIGN_TASK}") == 11 and "bulk=True" in log
    assert "@example.com" not in log


@pytest.mark.serial  # a pass must keep pace with a 4 s visibility timeout: alone, not beside other workers' load
def test_campaign_longer_than_the_visibility_timeout_is_never_handed_out_twice(
    app_for_fake: Any, fake: FakeProvider, worker_env: dict[str, str], start_worker: Any
) -> None:
    # The Redis transport hands a message out again once it has been held for visibility_timeout
    # (4 s here), even while its worker runs it. A campaign of ~10 s must hand the rest of its list
    # to a fresh message within half of that, every time, and count every pass's recipients.
    worker_env["IDEMMAIL_TEST_VT"] = "4"
    fake.latency = 0.02
    worker = start_worker("-P", "prefork", "-c", "2")  # a free pool slot for any copy handed out early
    app = app_for_fake.app
    n = 300
    recipients = [f"long{i}@example.com" for i in range(n)]
    ar = app.tasks[CAMPAIGN_TASK].delay(campaign_id="long-one", recipients=recipients, subject="Long",
                                        text="a long campaign", batch_size=10)
    out = ar.get(timeout=180)
    assert (out["total"], out["sent"], out["duplicate"], out["pending"]) == (n, n, 0, 0), out
    per_recipient = Counter(d.recipients[0] for d in fake.deliveries())
    assert len(per_recipient) == n and max(per_recipient.values()) == 1
    log = worker.log().decode()
    received = log.count(f"send_campaign[{ar.id}] received")
    passes_ended = log.count(f"send_campaign[{ar.id}] retry:")
    assert passes_ended >= 2, log[-3000:]  # it ran for longer than one pass may
    # Every message the worker received is the first one or one a pass published: none handed out again.
    assert received == passes_ended + 1, (received, passes_ended)


def test_campaign_pass_setting_bounds_each_pass_and_counts_survive(
    app_for_fake: Any, fake: FakeProvider, worker_env: dict[str, str], start_worker: Any
) -> None:
    # idemmail_campaign_pass_seconds=0.3 (RabbitMQ-like: no visibility timeout to derive it from here).
    worker_env["IDEMMAIL_TEST_CAMPAIGN_PASS"] = "0.3"
    fake.latency = 0.01
    worker = start_worker("-P", "solo")
    app = app_for_fake.app
    n = 120
    recipients = [f"paced{i}@example.com" for i in range(n)]
    single = app.tasks[TASK_NAME].delay(to="paced100@example.com", subject="Paced", text="one pass at a time",
                                        event_id="paced")
    assert results([single])[0]["status"] == "sent"
    ar = app.tasks[CAMPAIGN_TASK].delay(campaign_id="paced", recipients=recipients, subject="Paced",
                                        text="one pass at a time", batch_size=5)
    out = ar.get(timeout=120)
    # Counted across every pass: the one already sent is a duplicate wherever its pass began.
    assert (out["total"], out["sent"], out["duplicate"], out["pending"]) == (n, n - 1, 1, 0), out
    assert fake.delivery_count() == n
    assert worker.log().decode().count(f"send_campaign[{ar.id}] retry:") >= 3
