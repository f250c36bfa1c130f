"""Key-secret rotation in one rolling deploy (issue 35, item 4), with real workers on the Redis broker.

Mid-deploy, a worker still on ``[old]`` and one already on ``[new, old]`` run side by side, each on a
queue of its own so that the test decides which copy each one takes. The upgraded one used to make keys
under ``new``, which the old one can neither find nor check: two copies of one intent, one on each, were
both sent. Now every process makes keys under the newest secret every live worker holds (the roster).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import sqlalchemy as sa

from ..conftest import POSTGRES_URL, drop_ledger, service_missing
from .conftest import results

OLD_SECRETS, NEW_SECRETS = "test-secret", "two,test-secret"


def keys_delivered(sink: Any) -> list[str]:
    return sorted(d.split("|")[0] for d in sink.deliveries())


@pytest.mark.parametrize("pool", [("prefork", "1"), ("gevent", "100")], ids=["prefork", "gevent"])
def test_two_copies_on_an_old_and_an_upgraded_worker_mid_deploy_are_sent_once(
    app_module: Any, ns: str, sink: Any, start_worker: Any, pool: tuple[str, str]
) -> None:
    start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_KEY_SECRETS": OLD_SECRETS})
    upgraded_queue = f"q.{ns}.upgraded"
    start_worker("-P", pool[0], "-c", pool[1], "-Q", upgraded_queue, env={"IDEMMAIL_TEST_KEY_SECRETS": NEW_SECRETS})
    send, app = app_module.send, app_module.app
    old_key = send.intent_key("kim@example.com", 41)  # the test process is an old web process

    # Sent by name, without a key: each worker derives it. The upgraded worker goes first.
    first = results([app.send_task(send.name, ("kim@example.com", 41), queue=upgraded_queue)])[0]
    second = results([app.send_task(send.name, ("kim@example.com", 41))])[0]  # the old worker
    assert len(sink.deliveries()) == 1 and [first["status"], second["status"]] == ["sent", "duplicate"]
    assert first["key"] == second["key"] == old_key  # made under the secret both workers hold

    # From an upgraded web process: its key, and its seal, must be ones the old worker knows.
    app.conf.idemmail_key_secret = NEW_SECRETS.split(",")
    send._idem_settings = send._idem_builder = send._idem_handler = None
    out = [results([send.apply_async(("lee@example.com", 42), queue=queue)], timeout=90)[0]
           for queue in (upgraded_queue, None)]  # the upgraded worker first, then the old one
    assert [o["status"] for o in out] == ["sent", "duplicate"] and out[0]["key"] == out[1]["key"], out
    assert len(sink.deliveries()) == 2 and len(set(keys_delivered(sink))) == 2


def test_a_worker_starts_and_takes_messages_while_its_ledger_holds_up_its_announcement_and_claims_after_it(
    worker_env: dict[str, str], request: pytest.FixtureRequest, sink: Any, start_worker: Any
) -> None:
    """The first announcement used to be made in ``worker_init``: a ledger that did not answer it (here a
    PostgreSQL ledger whose roster table another session holds locked) kept the worker from starting at all.
    It starts now, takes messages and runs what needs no claim, and its idempotent deliveries claim only once
    the roster holds the worker (a worker lacking a secret the others hold must be seen before it claims)."""
    worker_env.update(IDEMMAIL_TEST_LEDGER=POSTGRES_URL)
    app_module = request.getfixturevalue("app_module")
    ledger = app_module.send.ledger
    try:
        ledger.prepare()  # the ledger's tables, the roster's among them
    except Exception as exc:
        service_missing("postgresql", exc)
    engine = sa.create_engine(POSTGRES_URL)
    key = app_module.send.intent_key("dot@example.com", 43)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'LOCK TABLE "{ledger.backend.roster_table.name}" IN ACCESS EXCLUSIVE MODE'))
            started = time.monotonic()
            worker = start_worker("-P", "prefork", "-c", "2")
            assert time.monotonic() - started < 45
            held = app_module.send.delay("dot@example.com", 43)
            other = app_module.plain_send.delay("eve@example.com", 44)
            assert results([other], timeout=30)[0]["message_id"]  # messages are taken meanwhile
            time.sleep(2)
            assert ledger.get(key) is None and len(sink.attempts()) == 1  # no claim before the announcement
            conn.rollback()  # the lock goes: the announcement lands
        assert results([held], timeout=30)[0]["status"] == "sent"
        assert worker.proc is not None
        assert any(e.member.endswith(f":{worker.proc.pid}") for e in ledger.roster())
        assert [d.split("|")[1] for d in sink.deliveries()] == ["eve@example.com", "dot@example.com"]
    finally:
        engine.dispose()
        drop_ledger(ledger.backend)
