"""Key secrets: rotating them never sends an intent again; a server ledger without one is refused."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from idemmail_celery import ConfigurationError, IdempotentTask
from idemmail_celery.chain import KEY_HEADER, OLDER_KEYS_HEADER, TENANT_HEADER

from .conftest import REDIS_URL, unique


def app_with(ledger_url: str, **conf: Any) -> Celery:
    app = Celery(unique("secrets"), set_as_current=False)
    app.conf.update(idemmail_ledger_url=ledger_url, **conf)
    return app


def sender(app: Celery, sent: list[str], name: str) -> Any:
    @app.task(base=IdempotentTask, name=name, shared=False, idempotency_key=("to", "order_id"))
    def send(to: str, order_id: int) -> dict[str, Any]:
        sent.append(to)
        return {"message_id": f"m-{len(sent)}"}

    return send


def test_rotating_the_key_secret_never_sends_an_intent_again(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    sent: list[str] = []
    name = unique("rot")
    before = sender(app_with(ledger, idemmail_key_secret="old-secret"), sent, name)
    assert before.apply(("ann@example.com", 1)).get()["status"] == "sent"
    after = sender(app_with(ledger, idemmail_key_secret=["new-secret", "old-secret"]), sent, name)
    headers = after.intent_headers(("ann@example.com", 1), {})
    assert headers[OLDER_KEYS_HEADER] == [before.intent_key("ann@example.com", 1)]
    assert headers[KEY_HEADER] != before.intent_key("ann@example.com", 1)
    replay = after.apply(("ann@example.com", 1), headers=headers).get()
    assert replay["status"] == "duplicate" and sent == ["ann@example.com"]
    # A message without the header (sent by name, or by an older release) is worked out at the worker.
    assert after.apply(("ann@example.com", 1)).get()["status"] == "duplicate" and len(sent) == 1
    # New intents go under the new secret.
    assert after.apply(("bob@example.com", 2)).get()["status"] == "sent"
    # A copy enqueued before the rotation (keyed under the old secret) finds an intent sent after it.
    old_headers = before.intent_headers(("bob@example.com", 2), {})
    assert after.apply(("bob@example.com", 2), headers=old_headers).get()["status"] == "duplicate"
    assert sent == ["ann@example.com", "bob@example.com"]
    one_secret = sender(app_with(ledger, idemmail_key_secret="new-secret"), sent, unique("one"))
    assert OLDER_KEYS_HEADER not in one_secret.intent_headers(("ann@example.com", 1), {})  # costs nothing


def test_a_server_ledger_without_a_key_secret_is_refused_before_anything_is_enqueued(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sent: list[str] = []
    redis_task = sender(app_with(REDIS_URL), sent, unique("nosecret"))
    with pytest.raises(ConfigurationError, match="idemmail_key_secret is not set"):
        redis_task.intent_headers(("ann@example.com", 1), {})
    allowed = sender(app_with(REDIS_URL, idemmail_allow_plain_keys="true"), sent, unique("plain"))
    assert allowed.intent_headers(("ann@example.com", 1), {})[KEY_HEADER]
    with caplog.at_level(logging.WARNING):
        dev = sender(app_with(f"sqlite:///{tmp_path / 'dev.sqlite3'}"), sent, unique("dev"))
        assert dev.intent_headers(("ann@example.com", 1), {})[KEY_HEADER]  # the development default


def test_a_raw_header_sent_by_name_during_a_rotation_finds_the_intent_recorded_before_it(tmp_path: Path) -> None:
    """`send_task(headers={"idempotency_key": "order-1"})` reaches the worker with no older keys: it works
    them out from the raw key itself (the arguments do not make an explicit key)."""
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
    sent: list[str] = []
    name = unique("rawrot")
    before = sender(app_with(ledger, idemmail_key_secret="old-secret"), sent, name)
    first = before.apply(("ann@example.com", 1), headers={KEY_HEADER: "order-1"}).get()
    assert first["status"] == "sent" and first["key"] == before.key_builder.explicit_key("order-1")
    after = sender(app_with(ledger, idemmail_key_secret=["new-secret", "old-secret"]), sent, name)
    for tenant in ({}, {TENANT_HEADER: "acme"}):  # the header's tenant namespaces every form alike
        if tenant:
            before.apply(("ann@example.com", 1), headers={KEY_HEADER: "order-1", **tenant}).get()
        replay = after.apply(("ann@example.com", 1), headers={KEY_HEADER: "order-1", **tenant}).get()
        assert replay["status"] == "duplicate"
    assert sent == ["ann@example.com", "ann@example.com"]  # once untenanted, once for acme: never again
    # A new raw key during the rotation goes under the new secret.
    fresh = after.apply(("ann@example.com", 1), headers={KEY_HEADER: "order-2"}).get()
    assert fresh["status"] == "sent" and fresh["key"] == after.key_builder.explicit_key("order-2")
