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
from idemmail_celery.mail import TASK_NAME
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
