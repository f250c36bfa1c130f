"""``send_digest`` keeps addresses out of what it returns and logs: a task's result is stored by the
result backend and shown by Flower, and a skipped recipient's log line reaches every log pipeline.

A real app on the in-memory broker and a SQLite ledger; the published messages are read back.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from idemmail_celery.beat import send_digest
from idemmail_celery.mail import register

from .conftest import unique

PEOPLE = ["ann.private@example.com", "Bob Private <bob.private@example.org>", "carol.private@example"]


@pytest.fixture
def app(tmp_path: Path) -> Celery:
    a = Celery(unique("digest"), broker="memory://", set_as_current=False)
    a.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", idemmail_key_secret="s",
                  idemmail_provider_url="console://", idemmail_default_from="Digests <digest@example.com>")
    register(a)
    return a


def fan_out(app: Celery, slot: str = "2026-11-21") -> dict[str, Any]:
    return send_digest(app, slot=slot, recipients=PEOPLE, subject="Your digest",
                       build_body=lambda to, s: {"text": f"News up to {s}"})


def test_the_fan_out_result_and_its_log_name_no_recipient(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="idemmail_celery"):
        result = fan_out(app)
    shown = json.dumps(result) + "\n".join(r.getMessage() for r in caplog.records)
    for leaked in ("private", "example.org", "example.com"):
        assert leaked not in shown, shown
    assert len(result["enqueued"]) == 2 and all(len(key) == 64 for key in result["enqueued"])
    [skipped] = result["invalid"]
    assert skipped["position"] == 2 and "not a valid address" in skipped["reason"]
    assert "recipient #2" in caplog.text


def test_the_keys_a_fan_out_returns_are_its_recipients_keys_in_order(app: Celery) -> None:
    task = app.tasks["idemmail_celery.send_email"]
    expected = [str(task.intent_key(to=to, event_id="digest:2026-11-21", template="digest")) for to in PEOPLE[:2]]
    assert fan_out(app)["enqueued"] == expected == fan_out(app)["enqueued"]  # a retried fan-out: the same keys
    assert not set(fan_out(app, "2026-11-22")["enqueued"]) & set(expected)  # the next slot: new keys


def test_a_header_only_the_library_writes_in_options_does_not_change_a_recipients_key(app: Celery) -> None:
    from celery.signals import before_task_publish

    from idemmail_celery.chain import KEY_HEADER, OWNER_HEADER

    published: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        published.append(dict(headers or {}))

    before_task_publish.connect(capture, weak=False)
    try:
        result = send_digest(app, slot="2026-11-21", recipients=PEOPLE[:1], subject="Your digest",
                             build_body=lambda to, s: {"text": "News"},
                             options={"headers": {"trace": "t", OWNER_HEADER: "copied"}})
    finally:
        before_task_publish.disconnect(capture)
    [message] = published
    assert message[KEY_HEADER] == result["enqueued"][0] and message["trace"] == "t" and OWNER_HEADER not in message
