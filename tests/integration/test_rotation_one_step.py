"""Key-secret rotation in one rolling deploy (issue 35, item 4), with real workers on the Redis broker.

Mid-deploy, a worker still on ``[old]`` and one already on ``[new, old]`` run side by side, each on a
queue of its own so that the test decides which copy each one takes. The upgraded one used to make keys
under ``new``, which the old one can neither find nor check: two copies of one intent, one on each, were
both sent. Now every process makes keys under the newest secret every live worker holds (the roster).
"""

from __future__ import annotations

from typing import Any

import pytest

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
