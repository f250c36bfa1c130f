"""The operator CLI against real Redis and PostgreSQL ledgers, legal and illegal moves alike."""

from __future__ import annotations

import base64
import getpass
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from click.testing import CliRunner

from idemmail_celery.cli import EXIT_ILLEGAL, EXIT_UNKNOWN_KEY, idemmail
from idemmail_celery.ledger import ClaimRequest, Ledger, State, from_url
from idemmail_celery.ledger.redis import RedisLedger
from idemmail_celery.ledger.sql import SQLLedger

from .conftest import POSTGRES_URL, REDIS_URL, drop_ledger, make_ledger, service_missing

# The worker tests' namespace fixtures (ns, worker_env, sink, app_module), reused here by name.
from .integration.conftest import app_module, ns, sink, worker_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


class _Obj:
    app = None


@pytest.fixture(params=["redis", "postgresql"])
def cli_ledger(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    led = make_ledger(request.param, tmp_path_factory)
    yield led
    drop_ledger(led)


def url_args(ledger: Ledger) -> list[str]:
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


def same_store(ledger: Ledger, **options: Any) -> Ledger:
    """Another ledger on ``ledger``'s prefix/table, with other options (a shorter retention)."""
    if isinstance(ledger, RedisLedger):
        return from_url(REDIS_URL, prefix=ledger.prefix, **options)
    assert isinstance(ledger, SQLLedger)
    return from_url(ledger.url.render_as_string(hide_password=False), table=ledger.table.name, **options)


def stored(ledger: Ledger, key: str) -> bool:
    """Is anything of ``key`` still in the store, expired or not (a Redis index entry, an SQL row)?"""
    if isinstance(ledger, RedisLedger):
        b = ledger._bucket(key)
        return bool(ledger.client.exists(ledger._rec(key))) or any(
            ledger.client.zscore(ledger._index(b, s), key) is not None for s in State)
    assert isinstance(ledger, SQLLedger)
    t = ledger.table
    return bool(ledger._run(lambda conn: conn.execute(sa.select(t.c.intent_key).where(t.c.intent_key == key)).first()))


def sent(ledger: Ledger, key: str) -> None:
    c = ledger.claim(ClaimRequest(key=key, task_name="t.send", payload="{}", fingerprint="f"))
    ledger.complete(key, c.token, {"message_id": f"m-{key}"})


def test_forget_and_purge(cli_ledger: Ledger) -> None:
    parked(cli_ledger, "k4")
    assert run(cli_ledger, "ledger", "forget", "k4").exit_code == 0
    record = cli_ledger.get("k4")
    assert record is not None and not record.payload and record.state is State.REVIEW
    assert run(cli_ledger, "ledger", "forget", "nope").exit_code == EXIT_UNKNOWN_KEY

    # One sent record past its retention, one within it (7 days), and k4 in review (never expires).
    short = same_store(cli_ledger, retention_seconds=0.2)
    try:
        sent(short, "old")
    finally:
        short.close()
    sent(cli_ledger, "fresh")
    time.sleep(0.5)
    assert cli_ledger.get("old") is None and stored(cli_ledger, "old")  # expired, not yet purged

    out = run(cli_ledger, "ledger", "purge", "--expired")
    assert out.exit_code == 0, out.output
    assert out.output.strip() == "purged 1 expired records"
    assert not stored(cli_ledger, "old")
    fresh = cli_ledger.get("fresh")
    assert fresh is not None and fresh.state is State.SENT and fresh.result == {"message_id": "m-fresh"}
    kept = cli_ledger.get("k4")
    assert kept is not None and kept.state is State.REVIEW
    assert run(cli_ledger, "ledger", "purge", "--expired").output.strip() == "purged 0 expired records"
    stats = json.loads(run(cli_ledger, "ledger", "stats", "--json").output)
    assert (stats["sent"], stats["review"]) == (1, 1)


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_init_and_ack_loss_on_an_sql_ledger(backend: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """SQL ledgers keep no epoch marker: init has nothing to do (exit 0), ack-loss refuses (exit 3)."""
    led = make_ledger(backend, tmp_path_factory)
    try:
        parked(led, "k5")
        before = led.get("k5")
        init = run(led, "ledger", "init", "--actor", "ana")
        assert init.exit_code == 0, init.output
        assert init.output.strip() == "this ledger is a durable SQL store: no epoch marker to create"
        ack = run(led, "ledger", "ack-loss", "--note", "restarted", "--actor", "ana")
        assert ack.exit_code == EXIT_ILLEGAL, ack.output
        assert "durable SQL store" in ack.output and "no loss to acknowledge" in ack.output
        assert "workers adopt" not in ack.output  # nothing claimed to have happened
        assert led.get("k5") == before  # neither wrote anything
        stats = json.loads(run(led, "ledger", "stats", "--json").output)
        assert stats["epoch"] is None and stats["review"] == 1
    finally:
        drop_ledger(led)


@dataclass
class ReleaseApp:
    workerapp: Any  # tests.integration.workerapp, configured for this test's namespace
    env: dict[str, str]  # for `celery -A tests.integration.workerapp ...` in a subprocess
    ns: str


@pytest.fixture(params=["redis", "postgresql"])
def release_app(request: pytest.FixtureRequest) -> Iterator[ReleaseApp]:
    """The worker app on this test's namespace (its queue on the Redis broker), its ledger on Redis or PostgreSQL."""
    env: dict[str, str] = request.getfixturevalue("worker_env")
    cleaner = request.getfixturevalue("sink")  # deletes the namespace's Redis keys afterwards
    if request.param == "postgresql":
        env["IDEMMAIL_TEST_LEDGER"] = POSTGRES_URL
    module = request.getfixturevalue("app_module")  # after the ledger URL is in worker_env
    try:
        module.send.ledger.ping()
    except Exception as exc:
        service_missing(request.param, exc)
    yield ReleaseApp(module, env, cleaner.ns)
    drop_ledger(module.send.ledger)
    cleaner.r.delete(f"q.{cleaner.ns}")


def park_first(workerapp: Any, to: str, order_id: int) -> str:
    send = workerapp.send
    key: str = send.intent_key(to, order_id)
    c = send.ledger.claim(ClaimRequest(
        key=key, task_name=send.name, fingerprint="f",
        payload=send.key_builder.payload((to, order_id), {"body": "first"}).to_json()))
    send.ledger.park(key, c.token, {"reason": "lease_expired"})
    return key


def celery_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "celery", "-A", "tests.integration.workerapp", "idemmail", "ledger", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def queued(app: ReleaseApp) -> list[dict[str, Any]]:
    return [json.loads(m) for m in redis.Redis.from_url(REDIS_URL).lrange(f"q.{app.ns}", 0, -1)]


def test_celery_subcommand_release_reenqueues_first_payload(
    release_app: ReleaseApp,
) -> None:
    """`celery -A app idemmail ledger resolve KEY --release` puts the stored payload back on the queue,
    and keeps who (default login@host), when and why in the record."""
    send = release_app.workerapp.send
    key = park_first(release_app.workerapp, "ann@example.com", 5)
    t0 = time.time()
    done = celery_cli(release_app.env, "resolve", key, "--release", "--note", "provider: not delivered")
    t1 = time.time()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{key}: released (re-enqueued)"
    messages = queued(release_app)
    assert len(messages) == 1
    assert messages[0]["headers"]["idempotency_key"] == key
    assert json.loads(base64.b64decode(messages[0]["body"]))[1] == {"body": "first"}

    record = send.ledger.get(key)
    assert record is not None and record.state is State.RELEASED and record.payload
    resolution = record.error["resolution"]
    assert resolution["by"] == f"{getpass.getuser()}@{socket.gethostname()}"
    assert resolution["note"] == "provider: not delivered"
    assert (resolution["from"], resolution["to"]) == ("review", "released")
    assert t0 <= resolution["at"] <= t1
    assert record.error["reason"] == "lease_expired"  # the parking reason stays beside the resolution

    # `ledger show` reports the same who/when/why.
    shown = run(send.ledger, "ledger", "show", key)
    assert shown.exit_code == 0, shown.output
    as_shown = json.loads(shown.output)
    assert as_shown["state"] == "released" and as_shown["error"]["resolution"] == resolution
    assert as_shown["has_payload"] is True and "payload" not in as_shown


def test_release_of_a_forgotten_payload_refuses_and_changes_nothing(
    release_app: ReleaseApp,
) -> None:
    """--release after `ledger forget`: nothing to re-enqueue, so exit 3, and the record stays in review."""
    key = park_first(release_app.workerapp, "bob@example.com", 6)
    led = release_app.workerapp.send.ledger
    assert run(led, "ledger", "forget", key).output.strip() == f"{key}: payload erased"
    before = led.get(key)
    assert before is not None and before.state is State.REVIEW and not before.payload

    done = celery_cli(release_app.env, "resolve", key, "--release", "--note", "provider: not delivered",
                      "--actor", "ana")
    assert done.returncode == EXIT_ILLEGAL, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"error: record {key} (review): its stored payload is gone (erased by `ledger")
    assert "nothing to re-enqueue; left unchanged" in done.stderr
    assert "re-enqueued" not in done.stdout
    assert queued(release_app) == []
    after = led.get(key)
    assert after == before  # still review, same token, no resolution recorded
    assert after is not None and "resolution" not in (after.error or {})
    # Still decidable the other ways.
    failed = run(led, "ledger", "resolve", key, "--failed", "--note", "cannot resend", "--actor", "ana")
    assert failed.exit_code == 0, failed.output
