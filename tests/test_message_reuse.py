"""send_email builds a run's message once: the check before the claim and the body share it, and
nothing else does (another run, other arguments, other settings, the client's own calls)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from idemmail_celery import mail
from idemmail_celery._request import state_of
from idemmail_celery.email import EmailMessage

CALL = {"to": "ann@example.com", "subject": "Your receipt", "text": "Thanks"}


@pytest.fixture
def task() -> Iterator[mail.SendEmailTask]:
    app = Celery("reuse", set_as_current=False)
    app.conf.update(idemmail_default_from="Shop <shop@example.com>", idemmail_provider_url="console://")
    yield mail.register(app)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    made: list[dict[str, Any]] = []
    real = EmailMessage.build

    def counted(**kw: Any) -> EmailMessage:
        made.append(kw)
        return real(**kw)

    monkeypatch.setattr(EmailMessage, "build", staticmethod(counted))
    return made


def as_the_body_calls_it(**kw: Any) -> dict[str, Any]:
    """deliver()'s argument: every message field named, None where the call left it out."""
    return {name: kw.get(name) for name in mail._MESSAGE_FIELDS} | {"subject": kw.get("subject", "")}


def test_the_body_reuses_the_message_the_check_built(task: mail.SendEmailTask, builds: list[Any]) -> None:
    task.push_request(id="run-1", called_directly=False)
    try:
        checked = task.message_from(dict(CALL, event_id="e-1"))
        sent = task.message_from(as_the_body_calls_it(**CALL))
    finally:
        task.pop_request()
    assert sent is checked and len(builds) == 1


def test_other_arguments_build_their_own_message(task: mail.SendEmailTask, builds: list[Any]) -> None:
    # A reopened claim runs the first payload, not the delivery's: its message is built from it.
    task.push_request(id="run-1", called_directly=False)
    try:
        task.message_from(dict(CALL))
        first = task.message_from(as_the_body_calls_it(**dict(CALL, subject="The first subject")))
    finally:
        task.pop_request()
    assert first.subject == "The first subject" and len(builds) == 2


def test_new_settings_build_a_new_message(task: mail.SendEmailTask, builds: list[Any]) -> None:
    task.push_request(id="run-1", called_directly=False)
    try:
        task.message_from(dict(CALL))
        # Settings are resolved once per task; resolved again (as tests that change them do), they count.
        task.app.conf.idemmail_default_from = "Other <other@example.com>"
        task._idem_settings = None
        again = task.message_from(dict(CALL))
    finally:
        task.pop_request()
    assert again.sender == "Other <other@example.com>" and len(builds) == 2


def test_nothing_is_kept_outside_a_run(task: mail.SendEmailTask, builds: list[Any]) -> None:
    # delay() on the client: its default request is shared by every call the thread makes.
    task.message_from(dict(CALL))
    task.message_from(dict(CALL))
    assert len(builds) == 2 and state_of(task.request, create=False) is None


def test_another_run_builds_its_own(task: mail.SendEmailTask, builds: list[Any]) -> None:
    for run in ("run-1", "run-2"):
        task.push_request(id=run, called_directly=False)
        try:
            task.message_from(dict(CALL))
        finally:
            task.pop_request()
    assert len(builds) == 2
