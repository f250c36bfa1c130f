"""The operator CLI against real Redis and PostgreSQL ledgers, legal and illegal moves alike."""

from __future__ import annotations

import base64
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from idemmail_celery.cli import EXIT_ILLEGAL, EXIT_UNKNOWN_KEY, idemmail
from idemmail_celery.ledger import ClaimRequest, Ledger, State

from .conftest import REDIS_URL, drop_ledger, make_ledger, unique

ROOT = Path(__file__).resolve().parents[1]


class _Obj:
    app = None


@pytest.fixture(params=["redis", "postgresql"])
def cli_ledger(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    led = make_ledger(request.param, tmp_path_factory)
    yield led
    drop_ledger(led)


def url_args(ledger: Ledger) -> list[str]:
    from idemmail_celery.ledger.redis import RedisLedger

    if isinstance(ledger, RedisLedger):
        kw = ledger.client.connection_pool.connection_kwargs
        return ["--ledger-url", f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}", "--prefix", ledger.prefix]
    return ["--ledger-url", ledger.url.render_as_string(hide_password=False),  # type: ignore[attr-defined]
            "--table", ledger.table.name]  # type: ignore[attr-defined]


def run(ledger: Ledger, *args: str) -> Any:
    return CliRunner().invoke(idemmail, [*url_args(ledger), *args], obj=_Obj())


def parked(ledger: Ledger, key: str) -> None:
    c = ledger.claim(ClaimRequest(key=key, task_name="t.send", payload='{"args":[],"kwargs":{"to":"a@x.org"}}',
                                  fingerprint="f" * 64))
    ledger.park(key, c.token, {"type": "SendNeedsReview", "reason": "lease_expired"})


def test_list_show_stats(cli_ledger: Ledger) -> None:
    parked(cli_ledger, "k1")
    out = run(cli_ledger, "ledger", "list", "--state", "review")
    assert out.exit_code == 0 and "k1" in out.output and "lease_expired" in out.output
    assert run(cli_ledger, "ledger", "list", "--state", "sent").output == ""
    shown = json.loads(run(cli_ledger, "ledger", "show", "k1").output)
    assert shown["state"] == "review" and "payload" not in shown and shown["has_payload"] is True
    with_payload = json.loads(run(cli_ledger, "ledger", "show", "k1", "--payload").output)
    assert with_payload["payload"]["kwargs"] == {"to": "a@x.org"}
    stats = json.loads(run(cli_ledger, "ledger", "stats", "--json").output)
    assert stats["review"] == 1 and stats["sent"] == 0


def test_resolve_sent_and_illegal_moves(cli_ledger: Ledger) -> None:
    parked(cli_ledger, "k2")
    out = run(cli_ledger, "ledger", "resolve", "k2", "--sent", "--message-id", "pm-77", "--note", "in provider log",
              "--actor", "ana")
    assert out.exit_code == 0, out.output
    record = cli_ledger.get("k2")
    assert record is not None and record.state is State.SENT and record.result["message_id"] == "pm-77"
    assert record.error["resolution"]["by"] == "ana" and record.error["resolution"]["note"] == "in provider log"
    again = run(cli_ledger, "ledger", "resolve", "k2", "--failed", "--note", "oops")
    assert again.exit_code == EXIT_ILLEGAL and "cannot be resolved" in again.output
    missing = run(cli_ledger, "ledger", "resolve", "nope", "--sent", "--note", "x")
    assert missing.exit_code == EXIT_UNKNOWN_KEY
    assert run(cli_ledger, "ledger", "show", "nope").exit_code == EXIT_UNKNOWN_KEY
    live = cli_ledger.claim(ClaimRequest(key="k3", task_name="t", payload="{}", fingerprint="f"))
    assert live.status.holds
    assert run(cli_ledger, "ledger", "resolve", "k3", "--failed", "--note", "x").exit_code == EXIT_ILLEGAL
    no_outcome = run(cli_ledger, "ledger", "resolve", "k2", "--note", "x")
    assert no_outcome.exit_code != 0 and "--sent, --failed or --release" in no_outcome.output
    no_app = run(cli_ledger, "ledger", "resolve", "k2", "--release", "--note", "x")
    assert no_app.exit_code != 0 and "celery -A" in no_app.output


def test_forget_and_purge(cli_ledger: Ledger) -> None:
    parked(cli_ledger, "k4")
    assert run(cli_ledger, "ledger", "forget", "k4").exit_code == 0
    record = cli_ledger.get("k4")
    assert record is not None and not record.payload and record.state is State.REVIEW
    assert run(cli_ledger, "ledger", "forget", "nope").exit_code == EXIT_UNKNOWN_KEY
    out = run(cli_ledger, "ledger", "purge", "--expired")
    assert out.exit_code == 0 and "purged" in out.output


def test_celery_subcommand_release_reenqueues_first_payload(tmp_path: Path) -> None:
    """`celery -A app idemmail ledger resolve KEY --release` puts the stored payload back on the queue."""
    ns = unique("cli").replace("_", "")
    env = {**os.environ, "IDEMMAIL_TEST_NS": ns, "PYTHONPATH": str(ROOT)}
    sys.modules.pop("tests.integration.workerapp", None)
    os.environ["IDEMMAIL_TEST_NS"] = ns
    try:
        workerapp = importlib.import_module("tests.integration.workerapp")  # fresh, for this namespace

        key = workerapp.send.intent_key("ann@example.com", 5)
        c = workerapp.send.ledger.claim(ClaimRequest(
            key=key, task_name=workerapp.send.name, fingerprint="f",
            payload=workerapp.send.key_builder.payload(("ann@example.com", 5), {"body": "first"}).to_json()))
        workerapp.send.ledger.park(key, c.token, {"reason": "lease_expired"})
        cmd = [sys.executable, "-m", "celery", "-A", "tests.integration.workerapp", "idemmail", "ledger", "resolve",
               key, "--release", "--note", "provider: not delivered"]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "released (re-enqueued)" in done.stdout
        r = redis.Redis.from_url(REDIS_URL)
        queued = [json.loads(m) for m in r.lrange(f"q.{ns}", 0, -1)]
        assert len(queued) == 1
        assert queued[0]["headers"]["idempotency_key"] == key
        assert json.loads(base64.b64decode(queued[0]["body"]))[1] == {"body": "first"}
        record = workerapp.send.ledger.get(key)
        assert record is not None and record.state is State.RELEASED
    finally:
        r = redis.Redis.from_url(REDIS_URL)
        for k in [*r.scan_iter(f"led.{ns}:*"), f"q.{ns}"]:
            r.delete(k)
        os.environ.pop("IDEMMAIL_TEST_NS", None)
        sys.modules.pop("tests.integration.workerapp", None)
