"""Issue 35, item 7: what a real worker's log says about a parked send, and about a provider it cannot build.

An operator reads the worker's log (what ``celery worker`` writes, captured here from its output): a send
parked for review is the library's one WARNING outcome line, not an ERROR with a traceback; a provider the
worker cannot build is one clear ERROR line before ``ready.`` that names the setting and no secret.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from idemmail_celery.errors import SendNeedsReview
from idemmail_celery.ledger import State, from_url

from ..conftest import REDIS_URL, require_module, wait_for
from .conftest import Sink, refusing_worker

#: A Celery worker log line: ``[2026-11-27 15:40:00,123: WARNING/ForkPoolWorker-1] ...``.
_LEVEL = re.compile(r"^\[[^\]]*: (DEBUG|INFO|WARNING|ERROR|CRITICAL)/")


def level(line: str) -> str | None:
    found = _LEVEL.match(line)
    return found.group(1) if found else None


POOLS = {"prefork": ["-P", "prefork", "-c", "2"], "threads": ["-P", "threads", "-c", "20"],
         "gevent": ["-P", "gevent", "-c", "100"]}


@pytest.mark.parametrize("pool", sorted(POOLS))
def test_parked_sends_are_one_warning_line_each_without_an_error_or_a_traceback(
    app_module: Any, ns: str, sink: Sink, start_worker: Any, pool: str
) -> None:
    if pool == "gevent":
        require_module("gevent")
    worker = start_worker(*POOLS[pool])
    orders = range(350, 358)
    for _ in range(2 * len(orders)):  # more than the sends: each takes one, racing the others
        sink.push_failure("ambiguous")  # sent, then a timeout: the outcome cannot be known, so it is parked
    ars = [app_module.send.delay("ann@example.com", n) for n in orders]
    for ar in ars:
        with pytest.raises(SendNeedsReview):
            ar.get(timeout=60)
    # Celery's own line about a task's end comes last: wait for them before reading the log.
    wait_for(lambda: all(re.search(rf"{ar.id}\] raised".encode(), worker.log()) for ar in ars), timeout=30)
    log = worker.log().decode(errors="replace")
    for ar in ars:
        about = [line for line in log.splitlines() if ar.id in line]
        warnings = [line for line in about if level(line) == "WARNING"]
        assert len(warnings) == 1 and "idemmail outcome status=review" in warnings[0], about
    assert [line for line in log.splitlines() if level(line) in ("ERROR", "CRITICAL")] == []
    assert "Traceback" not in log and "raised unexpected" not in log
    assert len(sink.deliveries()) == len(orders)
    ledger = from_url(REDIS_URL, prefix=f"led.{ns}")
    for n in orders:
        record = ledger.get(app_module.send.intent_key("ann@example.com", n))
        assert record is not None and record.state is State.REVIEW


def test_a_worker_whose_provider_cannot_be_built_says_which_setting_before_ready_and_can_refuse_to_start(
    worker_env: dict[str, str], start_worker: Any, tmp_path: Path
) -> None:
    # An SMTP URL without a user, and an API key: every send would fail. Before, the start-up line read
    # "... but the URL names no user (smtp:<address>)" twice (the example was scrubbed as an address).
    secret = "sekrit-4f1c9e"
    worker_env.update(IDEMMAIL_TEST_PROVIDER="smtp://127.0.0.1:2525", IDEMMAIL_TEST_PROVIDER_KEY=secret)
    log = start_worker("-P", "solo").log().decode(errors="replace")
    ready = log.index("ready.")
    errors = [line for line in log[:ready].splitlines() if level(line) == "ERROR"]
    assert len(errors) == 1, errors
    line = errors[0]
    assert "start-up check of idemmail_celery.send_email failed" in line
    assert "idemmail_provider_url (smtp://...) cannot be used" in line and "names no user" in line
    assert "<address>" not in line and line.count("names no user") == 1
    assert secret not in log
    code, text = refusing_worker(worker_env, tmp_path / "refusing.log")
    assert code != 0 and "refusing to start" in text and "ready." not in text
    assert "idemmail_provider_url (smtp://...) cannot be used" in text and secret not in text
