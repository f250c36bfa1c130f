"""A message whose arguments nest too deep is refused in the worker's main process, before the pool (issue 35).

A prefork worker's main process pickles each job for its child (Celery's ``asynpool``) before any
library code runs: ``send_email`` published by name with a tag nested 850 levels deep (about 1 KB)
made that pickling raise ``RecursionError``, which is an unrecoverable error for the main process;
the message went back to the queue and stopped the next worker the same way. The task's ``Request``
(``idemmail_celery.task.CheckedRequest``) now checks the decoded arguments first: the task ends
``FAILURE`` with ``PermanentSendError(reason="invalid_arguments")``, acknowledged, nothing stored
or sent, and the worker lives on. The same on every pool.
"""

from __future__ import annotations

import time
from typing import Any

from idemmail_celery import PermanentSendError
from idemmail_celery.chain import KEY_MARK_HEADER
from idemmail_celery.mail import ARGUMENT_SLACK, TASK_NAME
from idemmail_celery.testing.fake_provider import FakeProvider

from .conftest import WorkerProcess, results

KIM = {"to": "kim@example.com", "subject": "Your receipt", "text": "Thanks", "event_id": "order-35"}
def nested(levels: int) -> Any:
    value: Any = "x"
    for _ in range(levels):
        value = [value]
    return value


def stays_up(worker: WorkerProcess, seconds: float) -> None:
    """The worker's main process is still running ``seconds`` from now (checked all along)."""
    assert worker.proc is not None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert worker.proc.poll() is None, worker.log()[-3000:]
        time.sleep(0.5)


def test_a_message_nested_850_deep_is_refused_before_the_pool_and_the_worker_lives(
    fake_app: Any, fake: FakeProvider, fake_pool_worker: WorkerProcess
) -> None:
    worker = fake_pool_worker
    app = fake_app.app
    deep = app.send_task(TASK_NAME, kwargs={**KIM, "tags": {"t": nested(850)}})
    out = results([deep], timeout=45)[0]
    assert isinstance(out, PermanentSendError) and out.reason == "invalid_arguments", out
    assert "nested more than 100 levels" in str(out)
    assert deep.state == "FAILURE"
    stays_up(worker, 10)
    log = worker.log()
    assert b"Unrecoverable error" not in log and b"exited with" not in log
    assert list(app.tasks[TASK_NAME].ledger.iter_records()) == [] and fake.delivery_count() == 0
    # The refusal was made in the main process, before the pool ran anything of the task.
    assert b"refused before the pool" in log
    good = results([app.tasks[TASK_NAME].delay(**KIM)])[0]
    assert good["status"] == "sent" and fake.delivery_count() == 1


def test_arguments_over_the_tasks_size_bound_are_refused_before_the_pool(
    fake_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    """``send_email``'s bound: its size budget (10 MiB) and 64 KiB; over it, the worker's main process refuses the
    message before pickling it for a child (an email that large was refused in the child before, as invalid)."""
    worker = start_worker("-P", "prefork", "-c", "1")
    app = fake_app.app
    big = app.send_task(TASK_NAME, kwargs={**KIM, "text": "x" * (app.tasks[TASK_NAME].max_argument_size() + 1)})
    out = results([big], timeout=60)[0]
    assert isinstance(out, PermanentSendError) and out.reason == "invalid_arguments", out
    assert "larger than" in str(out) and b"refused before the pool" in worker.log()
    assert list(app.tasks[TASK_NAME].ledger.iter_records()) == [] and fake.delivery_count() == 0


def test_a_retry_of_an_accepted_intent_passes_a_bound_lowered_since_and_unsealed_copies_do_not(
    app_module: Any, sink: Any, start_worker: Any
) -> None:
    """The size bound is the task's (``max_argument_size``, for ``send_email`` a setting): an operator may lower
    it between deploys. An intent accepted under the old bound (its seal says so) goes on: the bound lowered
    while its first attempt failed used to refuse its retry in the main process, FAILURE, its record left
    ``released`` with nothing sent. A message without a seal, or with a forged one, is still refused."""
    worker = start_worker("-P", "prefork", "-c", "1")
    send, app = app_module.send_bounded, app_module.app
    body = "x" * 2000
    sink.push_failure("lower_bound")  # the first attempt lowers the bound to 100 and fails before sending
    out = results([send.delay("kim@example.com", 35, body=body)], timeout=45)[0]
    assert isinstance(out, dict) and out["status"] == "sent", out
    assert sink.r.get(sink.k("ctl.max_args")) == "100"
    assert [d.split("|")[1:] for d in sink.deliveries()] == [["kim@example.com", body]]
    assert send.ledger.get(out["key"]).state.value == "sent"

    # What the library did not seal for these arguments meets today's bound: by name; a seal copied from another
    # call's message; a seal naming a secret this worker does not hold.
    sealed = send.intent_headers(("lee@example.com", 36), {"body": "short"})
    forged = [{}, sealed, {**sealed, KEY_MARK_HEADER: "0123456789ab:" + "0" * 64}]
    refused = results([app.send_task(send.name, ("lee@example.com", 36), {"body": body}, headers=headers)
                       for headers in forged], timeout=45)
    for got in refused:
        assert isinstance(got, PermanentSendError) and got.reason == "invalid_arguments", got
        assert "larger than 100" in str(got)
    assert len(sink.deliveries()) == 1 and worker.log().count(b"refused before the pool") == 3


def test_an_email_accepted_under_a_larger_budget_is_sent_by_a_worker_deployed_with_a_smaller_one(
    fake_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    """``idemmail_max_message_bytes`` lowered while a message accepted under the old budget waits in the queue
    (or retries): neither the worker's main process (the argument bound) nor its check before the claim (the
    message's size) drops it. The same email sent by name, without the library's seal, is refused."""
    budget = 64 * 1024
    worker = start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_MAX_MESSAGE_BYTES": str(budget)})
    task = fake_app.app.tasks[TASK_NAME]  # this process is a web process still on the 10 MiB default
    big = {**KIM, "text": "x" * (budget + ARGUMENT_SLACK + 1000)}
    out = results([task.delay(**big)], timeout=45)[0]
    assert isinstance(out, dict) and out["status"] == "sent", out
    assert fake.delivery_count() == 1

    by_name = results([fake_app.app.send_task(TASK_NAME, kwargs={**big, "event_id": "order-36"})], timeout=45)[0]
    assert isinstance(by_name, PermanentSendError) and by_name.reason == "invalid_arguments", by_name
    assert fake.delivery_count() == 1 and b"refused before the pool" in worker.log()
