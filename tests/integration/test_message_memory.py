"""A worker's main process keeps no copy of a message once its task is done (issue 35).

Celery decodes every message in the worker's main process, and kombu's virtual transports (Redis
here) keep an acknowledged message in their record of delivered messages until the next message
arrives: with it its body, the raw payload it was made of (the body again, in base64) and kombu's
cache of the decoded body. After its last large messages a worker's main process kept the last few
for as long as its queue stayed quiet: about 35 MB each for ``send_email``'s largest. The task's
``Request`` (``idemmail_celery._request.CheckedRequest``) now lets the message go of the raw payload
and the decoding when it is made, of the body once the message is settled. Prefork and threads
pools acknowledge through kombu's event loop, a moment after the task; gevent at once.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import FakeProvider

from ..conftest import wait_for
from .conftest import WorkerProcess, results

MIB = 1 << 20


def message_copies(app: Any, worker: WorkerProcess) -> dict[str, int]:
    """What the kombu messages alive in ``worker``'s main process hold (``workerapp.message_copies``)."""
    node = f"{worker.ns}-{id(worker) % 10**6}-{worker.starts}@{socket.gethostname()}"
    replies = app.control.broadcast("message_copies", destination=[node], reply=True, timeout=5)
    [reply] = [r[node] for r in replies if node in r]
    return dict(reply)


def test_the_main_process_keeps_no_copy_of_a_message_once_its_task_is_done(
    fake_app: Any, fake: FakeProvider, fake_pool_worker: WorkerProcess
) -> None:
    app = fake_app.app
    task = app.tasks[TASK_NAME]
    sent = [task.delay(to=f"kim{i}@example.com", subject="Your statement", text="x" * MIB, event_id=f"statement-{i}")
            for i in range(3)]
    assert [r["status"] for r in results(sent)] == ["sent"] * 3 and fake.delivery_count() == 3
    held: dict[str, int] = {}

    def let_go() -> bool:
        held.update(message_copies(app, fake_pool_worker))
        return held["body"] + held["raw"] + held["decoded"] < 64 * 1024

    # Before: the last messages' bodies, payloads and decodings (each over 1 MiB), kept until another message came.
    try:
        wait_for(let_go, timeout=15, interval=0.5)
    except AssertionError:
        pytest.fail(f"the worker's main process still holds {held}")
    assert held["messages"] >= 1, held  # the check saw the process's messages: a remote-control one at least
