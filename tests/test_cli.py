"""The operator CLI against real Redis and PostgreSQL ledgers, legal and illegal moves alike."""

from __future__ import annotations

import base64
import getpass
import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
import redis
import sqlalchemy as sa
from click.testing import CliRunner

from idemmail_celery.cli import EXIT_BROKER, EXIT_ILLEGAL, EXIT_UNKNOWN_KEY, EXIT_UNREACHABLE, idemmail, standalone
from idemmail_celery.keys import Seal
from idemmail_celery.ledger import ClaimRequest, Ledger, State, from_url
from idemmail_celery.ledger.redis import RedisLedger
from idemmail_celery.ledger.sql import SQLLedger
from idemmail_celery.ledger.wrapper import LedgerWrapper

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
    if isinstance(ledger, LedgerWrapper):  # a task's ledger is timed for metrics: the store is inside
        ledger = ledger.backend
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


def test_list_pages_in_the_order_records_were_parked_with_filters_and_a_cursor(cli_ledger: Ledger) -> None:
    """``ledger list`` is the admin's listing: oldest first, a label without addresses, filters, and a cursor to
    go on from where a page stopped."""
    for key in ("k-a", "k-b", "k-c"):
        parked(cli_ledger, key)
    c = cli_ledger.claim(ClaimRequest(key="k-d", task_name="t.other", fingerprint="f" * 64,
                                      payload='{"args":[],"kwargs":{"to":"b@y.org","template":"receipt"}}'))
    cli_ledger.park("k-d", c.token, {"type": "SendNeedsReview", "reason": "after_data"})

    def keys(*args: str) -> list[str]:
        out = run(cli_ledger, "ledger", "list", "--state", "review", *args)
        assert out.exit_code == 0, out.output
        return [line.split()[0] for line in out.stdout.splitlines()]

    first = run(cli_ledger, "ledger", "list", "--state", "review", "--limit", "2")
    assert [line.split()[0] for line in first.stdout.splitlines()] == ["k-a", "k-b"]
    cursor = first.stderr.split("--cursor ")[1].strip()
    assert keys("--cursor", cursor) == ["k-c", "k-d"]
    assert keys("--reason", "after_data") == ["k-d"] and keys("--task", "t.send") == ["k-a", "k-b", "k-c"]
    assert keys("--newest-first", "--limit", "1") == ["k-d"]
    assert keys("--search", "x.org") == ["k-a", "k-b", "k-c"] and keys("--search", "a@x.org") == []
    assert keys("--since", "2000-01-01", "--until", "2000-01-02") == []
    line = run(cli_ledger, "ledger", "list", "--state", "review", "--search", "receipt").stdout
    assert line.startswith("k-d  review") and "after_data" in line and line.rstrip().endswith("receipt · @y.org")
    shown = json.loads(run(cli_ledger, "ledger", "list", "--search", "k-d", "--json").stdout)
    assert shown["label"] == "receipt · @y.org" and "payload" not in shown
    for bad in (["--since", "yesterday"], ["--cursor", "nonsense"], ["--limit", "0"]):
        refused = run(cli_ledger, "ledger", "list", *bad)
        assert refused.exit_code == 2, (bad, refused.output)


def test_resolve_sent_and_illegal_moves(cli_ledger: Ledger) -> None:
    parked(cli_ledger, "k2")
    out = run(cli_ledger, "ledger", "resolve", "k2", "--sent", "--message-id", "pm-77", "--note", "in provider log",
              "--actor", "ana")
    assert out.exit_code == 0, out.output
    record = cli_ledger.get("k2")
    assert record is not None and record.state is State.SENT and record.result["message_id"] == "pm-77"
    assert record.resolution["by"] == "ana" and record.resolution["note"] == "in provider log"
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
        b = ledger.names.bucket(key)
        return bool(ledger.client.exists(ledger.names.record(key))) or any(
            ledger.client.zscore(ledger.names.index(b, s), key) is not None for s in State)
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
    assert cli_ledger.get("old") is None
    # Expired, not yet purged: an SQL row stays until purge; a Redis record goes by its TTL (purge counts it).
    assert stored(cli_ledger, "old") is not isinstance(cli_ledger, RedisLedger)

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


def test_ledger_migrate_adopts_upgrades_and_takes_back_an_sql_ledger(cli_ledger: Ledger) -> None:
    """``ledger migrate``: a ledger its workers created is recorded at the newest revision; ``--down-to`` takes a
    step back (the step 5 columns go) and the next ``migrate`` brings them back; a Redis ledger has nothing to
    migrate (exit 2)."""
    from idemmail_celery.ledger.sql import migrate

    parked(cli_ledger, "m1")
    out = run(cli_ledger, "ledger", "migrate")
    if isinstance(cli_ledger.backend, RedisLedger):
        assert out.exit_code == 2 and "not a SQL ledger" in out.output
        return
    table = cli_ledger.table.name  # type: ignore[attr-defined]
    try:
        assert out.exit_code == 0, out.output
        assert out.output.strip() == f"ledger table {table}: no recorded revision -> {migrate.HEAD}"
        back = run(cli_ledger, "ledger", "migrate", "--down-to", "0004")
        assert back.exit_code == 0 and back.output.strip().endswith(f"{migrate.HEAD} -> 0004"), back.output
        engine = cli_ledger.engine  # type: ignore[attr-defined]
        assert "mark" not in {c["name"] for c in sa.inspect(engine).get_columns(table)}
        unknown = run(cli_ledger, "ledger", "migrate", "--to", "9999")
        assert unknown.exit_code == 2 and "9999" in unknown.output
        again = run(cli_ledger, "ledger", "migrate")
        assert again.exit_code == 0 and again.output.strip().endswith(f"0004 -> {migrate.HEAD}"), again.output
        record = cli_ledger.get("m1")
        assert record is not None and record.state is State.REVIEW
    finally:
        with cli_ledger.engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {migrate.version_table(table)}"))


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


@pytest.mark.worker  # runs `celery ... idemmail` in an interpreter of its own
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
    resolution = record.resolution
    assert resolution["by"] == f"{getpass.getuser()}@{socket.gethostname()}"
    assert resolution["note"] == "provider: not delivered"
    assert (resolution["from"], resolution["to"]) == ("review", "released")
    assert t0 <= resolution["at"] <= t1
    assert record.error["reason"] == "lease_expired"  # the parking reason stays beside the resolution

    # `ledger show` reports the same who/when/why.
    shown = run(send.ledger, "ledger", "show", key)
    assert shown.exit_code == 0, shown.output
    as_shown = json.loads(shown.output)
    assert as_shown["state"] == "released" and as_shown["resolution"] == resolution
    assert as_shown["has_payload"] is True and "payload" not in as_shown


@pytest.mark.worker  # runs `celery ... idemmail` in an interpreter of its own
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
    assert after is not None and after.resolution is None
    # Still decidable the other ways.
    failed = run(led, "ledger", "resolve", key, "--failed", "--note", "cannot resend", "--actor", "ana")
    assert failed.exit_code == 0, failed.output


# -- operator safety (issue 14) and the standalone CLI (issue 15) --


@pytest.mark.worker  # runs `celery ... idemmail` in an interpreter of its own
def test_release_with_the_broker_down_leaves_the_record_in_review(release_app: ReleaseApp) -> None:
    """Published first: the broker refuses, so nothing is queued and the record is exactly as it was."""
    key = park_first(release_app.workerapp, "cat@example.com", 7)
    led = release_app.workerapp.send.ledger
    before = led.get(key)
    down = {**release_app.env, "IDEMMAIL_TEST_BROKER": "redis://127.0.0.1:9/0"}  # nothing listens on port 9
    done = celery_cli(down, "resolve", key, "--release", "--note", "provider: not delivered")
    assert done.returncode == EXIT_BROKER, (done.stdout, done.stderr)
    assert "nothing queued, the record is left as it was" in done.stderr and "Traceback" not in done.stderr
    assert led.get(key) == before  # still review, same token, no resolution
    assert queued(release_app) == []


@pytest.mark.worker  # runs `celery ... idemmail` in an interpreter of its own
def test_a_second_release_does_not_queue_a_second_copy(release_app: ReleaseApp) -> None:
    key = park_first(release_app.workerapp, "dan@example.com", 8)
    first = celery_cli(release_app.env, "resolve", key, "--release", "--note", "provider: not delivered")
    assert first.returncode == 0, first.stderr
    released = release_app.workerapp.send.ledger.get(key)
    again = celery_cli(release_app.env, "resolve", key, "--release", "--note", "once more")
    assert again.returncode == EXIT_ILLEGAL, (again.stdout, again.stderr)
    assert "already released, so a copy is queued" in again.stderr
    assert len(queued(release_app)) == 1
    assert release_app.workerapp.send.ledger.get(key) == released


@pytest.mark.worker  # runs `celery ... idemmail` in an interpreter of its own
@pytest.mark.serial  # the release must land within the copy's countdown: alone, not beside others' load
def test_the_released_copy_cannot_arrive_before_the_record_is_released(release_app: ReleaseApp) -> None:
    """The copy is published with a countdown; releasing happens within it."""
    from idemmail_celery.cli import RELEASE_COUNTDOWN

    key = park_first(release_app.workerapp, "eve@example.com", 9)
    before_publish = time.time()
    assert celery_cli(release_app.env, "resolve", key, "--release", "--note", "n").returncode == 0
    [message] = queued(release_app)
    eta = message["headers"]["eta"]
    assert eta is not None
    import datetime as dt

    assert dt.datetime.fromisoformat(eta).timestamp() >= before_publish + RELEASE_COUNTDOWN - 1
    record = release_app.workerapp.send.ledger.get(key)
    assert record is not None and record.state is State.RELEASED and record.updated_at < before_publish + 5


def test_release_that_cannot_record_after_publishing_leaves_the_record_as_it_was(
    release_app: ReleaseApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger fails between the publish and the release: exit 4, record unchanged; the queued copy will
    meet the record in review and send nothing (a delivery of a review record replays it)."""
    from idemmail_celery.errors import LedgerUnavailableError

    key = park_first(release_app.workerapp, "fay@example.com", 10)
    led = release_app.workerapp.send.ledger
    before = led.get(key)

    class Holder:
        app = release_app.workerapp.app

    def down(*_: Any, **__: Any) -> Any:
        raise LedgerUnavailableError("connection refused (injected after the publish)")

    from idemmail_celery.ledger.base import Ledger as LedgerBase

    monkeypatch.setattr(LedgerBase, "resolve", down)  # the store's answer to the release step only
    failed = CliRunner().invoke(idemmail, ["ledger", "resolve", key, "--release", "--note", "n"], obj=Holder())
    monkeypatch.undo()
    assert failed.exit_code == EXIT_UNREACHABLE, failed.output
    assert "will find it unchanged and send nothing" in failed.output
    assert led.get(key) == before
    assert [m["headers"]["idempotency_key"] for m in queued(release_app)] == [key]


def test_a_slow_release_queues_a_second_copy_so_something_is_queued_after_it(
    release_app: ReleaseApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Releasing took half the countdown: the first copy may have met the record unreleased and sent nothing,
    so a second copy (no countdown) is queued behind the release. A copy too many only replays."""
    from idemmail_celery import cli
    from idemmail_celery.ledger.base import Ledger as LedgerBase

    key = park_first(release_app.workerapp, "hal@example.com", 12)
    original = LedgerBase.resolve

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cli, "RELEASE_COUNTDOWN", 0.4)
    monkeypatch.setattr(LedgerBase, "resolve", slow)

    class Holder:
        app = release_app.workerapp.app

    done = CliRunner().invoke(idemmail, ["ledger", "resolve", key, "--release", "--note", "n"], obj=Holder())
    assert done.exit_code == 0, done.output
    copies = queued(release_app)
    assert [m["headers"]["idempotency_key"] for m in copies] == [key, key]
    assert sorted(m["headers"]["eta"] is None for m in copies) == [False, True]  # one delayed, one at once
    assert release_app.workerapp.send.ledger.get(key).state is State.RELEASED  # type: ignore[union-attr]


def test_show_payload_of_a_sealed_record_without_keys_exits_6_without_a_traceback(cli_ledger: Ledger) -> None:
    from cryptography.fernet import Fernet

    from idemmail_celery.cli import EXIT_PAYLOAD_KEY

    sealed = same_store(cli_ledger, payload_keys=[Fernet.generate_key().decode()])
    try:
        parked(sealed, "k-sealed")
    finally:
        sealed.close()
    shown = run(cli_ledger, "ledger", "show", "k-sealed")
    assert shown.exit_code == 0 and json.loads(shown.output)["has_payload"] is True
    with_payload = run(cli_ledger, "ledger", "show", "k-sealed", "--payload")
    assert with_payload.exit_code == EXIT_PAYLOAD_KEY, with_payload.output
    assert "sealed" in with_payload.output and isinstance(with_payload.exception, SystemExit)
    assert "a@x.org" not in with_payload.output


def test_exit_codes_are_distinct_from_usage_errors(cli_ledger: Ledger) -> None:
    from idemmail_celery import cli

    codes = {name: getattr(cli, name) for name in dir(cli) if name.startswith("EXIT_") and name != "EXIT_CODES"}
    assert len(set(codes.values())) == len(codes), codes
    assert set(codes.values()) == set(cli.EXIT_CODES)  # every code has its meaning in the one table
    assert run(cli_ledger, "ledger", "show", "nope").exit_code == EXIT_UNKNOWN_KEY != 2
    assert run(cli_ledger, "ledger", "resolve", "nope", "--sent").exit_code == 2  # --note missing: click's usage


@pytest.mark.worker
def test_python_m_shows_every_subcommand_as_the_celery_subcommand_does(request: pytest.FixtureRequest) -> None:
    env: dict[str, str] = request.getfixturevalue("worker_env")

    def out(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    celery_app = ["-A", "tests.integration.workerapp", "idemmail"]
    subcommands = ("list", "show", "resolve", "purge", "forget", "stats", "init", "ack-loss")
    # Three interpreters prove the two doors (``python -m`` and Celery's ``celery.commands`` entry point);
    # each subcommand's help is then compared in this process (an interpreter each was 19 of them, 27 s).
    commands = [("-m", "idemmail_celery", "--help")] + [
        (*argv, "ledger", "--help") for argv in (["-m", "idemmail_celery"], ["-m", "celery", *celery_app])]
    with ThreadPoolExecutor(max_workers=3) as pool:
        top, *listings = pool.map(lambda args: out(*args), commands)
    assert "ledger" in top and "-A, --app" in top and "--ledger-url" in top and "7  no record for that key" in top
    for listing in listings:
        assert all(f"  {name} " in listing for name in subcommands), listing

    from celery.bin.celery import celery as celery_command

    runner = CliRunner()
    for name in subcommands:
        mine = runner.invoke(standalone(), ["ledger", name, "--help"], prog_name="python -m idemmail_celery")
        celerys = runner.invoke(celery_command, [*celery_app, "ledger", name, "--help"], prog_name="celery")
        assert mine.exit_code == celerys.exit_code == 0, (mine.output, celerys.output)
        assert mine.output.split("Options:")[1] == celerys.output.split("Options:")[1], name


def test_the_exit_codes_are_written_once_and_help_and_docs_are_made_from_them() -> None:
    import importlib.util

    from idemmail_celery import cli

    help_text = CliRunner().invoke(cli.standalone(), ["--help"]).output
    listed = re.findall(r"^\s+(\d+)  \S", help_text.split("Exit codes:")[1], re.MULTILINE)
    assert [int(code) for code in listed] == list(cli.EXIT_CODES)
    assert " ".join(help_text.split()).count(" ".join(cli.EXIT_CODES[cli.EXIT_ILLEGAL].split())) == 1
    assert ":data:`EXIT_CODES`" in (cli.__doc__ or "")  # the docstring points to the table, no copy of it:
    assert not re.search(r"^[0-9]\s{2,}\S", cli.__doc__ or "", re.MULTILINE)

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = (ROOT / "docs" / "operations.md").read_text()
    assert page.count(hooks.EXIT_CODES) == 1 and "| exit |" not in page
    rows = hooks.exit_codes_table().splitlines()[2:]
    assert rows == [f"| {code} | {meaning} |" for code, meaning in cli.EXIT_CODES.items()]


def test_every_command_and_option_says_what_it_does_in_plain_text() -> None:
    from idemmail_celery import cli

    group = cli.standalone()
    commands: list[tuple[str, ...]] = [(), ("ledger",)] + [("ledger", name) for name in cli.ledger.commands]
    for path in commands:
        command: Any = group
        for name in path:
            command = command.commands[name]
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"{' '.join(path)} {param.opts[0]} has no description"
                assert not (param.is_flag and param.required), f"{' '.join(path)} {param.opts[0]}: a required flag"
        text = CliRunner().invoke(group, [*path, "--help"]).output
        assert "``" not in text and ":data:" not in text, text  # reStructuredText markup shows literally
        assert not re.search(r"until \d+\.\d", text), text  # no history of the numbering in a help
    listing = CliRunner().invoke(group, ["ledger", "list", "--help"]).output
    assert "not guaranteed" not in listing and "--state" in listing


def test_docs_says_where_the_pages_are_in_a_checkout(tmp_path: Path) -> None:
    from idemmail_celery import cli

    listing = CliRunner().invoke(cli.standalone(), ["docs"])
    assert listing.exit_code == 0 and f"start with {ROOT / 'docs' / 'index.md'}" in listing.output
    assert "configuration.md" in listing.output and "Configuration" in listing.output
    assert CliRunner().invoke(cli.standalone(), ["docs", "--path"]).output.strip() == str(ROOT / "docs")


def test_docs_finds_the_pages_a_wheel_installed_under_its_prefix(tmp_path: Path) -> None:
    from importlib import metadata

    from idemmail_celery.cli import installed_docs

    site = tmp_path / "lib" / "site-packages"
    info = site / "idemmail_celery-0.1.0.dist-info"
    pages = tmp_path / "share" / "doc" / "idemmail-celery"
    info.mkdir(parents=True)
    pages.mkdir(parents=True)
    (pages / "index.md").write_text("# idemmail-celery\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: idemmail-celery\nVersion: 0.1.0\n")
    # As pip writes the RECORD of a wheel's data files: relative to site-packages.
    (info / "RECORD").write_text("idemmail_celery/__init__.py,,\n../../share/doc/idemmail-celery/index.md,,\n")
    assert installed_docs(metadata.Distribution.at(info)) == pages.resolve()
    (pages / "index.md").unlink()
    assert installed_docs(metadata.Distribution.at(info)) is None


def test_purge_without_expired_is_a_usage_error_and_deletes_nothing(cli_ledger: Ledger) -> None:
    cli_ledger.claim(ClaimRequest(key="k-purge", task_name="t", payload="{}", fingerprint="f"))
    done = run(cli_ledger, "ledger", "purge")
    assert done.exit_code == 2 and "--expired" in done.output
    assert cli_ledger.get("k-purge") is not None


@pytest.mark.worker  # runs `celery ... idemmail` in an interpreter of its own
def test_release_of_a_stored_payload_the_task_now_refuses_exits_3_and_leaves_it_in_review(
    release_app: ReleaseApp,
) -> None:
    """A payload stored before a rule was tightened (two addresses in one string): checked as apply_async
    checks a new call, before anything is published or changed. Released, the worker would refuse the
    copy before its claim: the record would stay released with nothing queued, and a second --release
    would be refused as "a copy is queued"."""
    send_email = release_app.workerapp.app.tasks["idemmail_celery.send_email"]
    led = send_email.ledger
    key = "5e" * 32
    stale = {"to": "ann@x.com, eve@y.com", "subject": "Your receipt", "text": "t", "event_id": "order-9"}
    c = led.claim(ClaimRequest(key=key, task_name=send_email.name, fingerprint="",
                               payload=json.dumps({"args": [], "kwargs": stale})))
    led.park(key, c.token, {"reason": "lease_expired"})
    before = led.get(key)
    env = {**release_app.env, "IDEMMAIL_TEST_PROVIDER": "console://"}
    done = celery_cli(env, "resolve", key, "--release", "--note", "provider: not delivered")
    assert done.returncode == EXIT_ILLEGAL, (done.stdout, done.stderr)
    assert "the task refuses its stored payload (InvalidEmail: to holds more than one address" in done.stderr
    assert "ann@x.com" not in done.stderr and "Traceback" not in done.stderr
    assert queued(release_app) == []
    assert led.get(key) == before  # still review: decidable the other ways


def test_the_release_countdown_stays_below_the_brokers_visibility_timeout(
    release_app: ReleaseApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy held back longer than the visibility timeout is handed out again (Redis, SQS) while the first
    worker still waits on it: the countdown takes at most half of it, like every countdown the library sets."""
    app = release_app.workerapp.app
    monkeypatch.setitem(app.conf.broker_transport_options, "visibility_timeout", 3)
    key = park_first(release_app.workerapp, "ivy@example.com", 13)

    class Holder:
        app = release_app.workerapp.app

    done = CliRunner().invoke(idemmail, ["ledger", "resolve", key, "--release", "--note", "n"], obj=Holder())
    after = time.time()  # the copy was published before this: its ETA is at most its countdown past it
    assert done.exit_code == 0, done.output
    import datetime as dt

    etas = sorted(dt.datetime.fromisoformat(m["headers"]["eta"]).timestamp() for m in queued(release_app)
                  if m["headers"]["eta"])
    # Measured from the command's end, not its start: on a loaded machine the command itself took 3 s (CI,
    # 2026-11-29). A countdown of 5 s (the long-timeout one) would put the ETA 3.5 s or more past this bound.
    assert etas and all(eta <= after + 1.5 for eta in etas), (etas, after)
    from idemmail_celery.cli import release_countdown

    assert release_countdown(app) == 1.5
    monkeypatch.setitem(app.conf.broker_transport_options, "visibility_timeout", 3600)
    assert release_countdown(app) == 5.0  # the usual countdown when the timeout is long


@pytest.mark.worker  # runs `celery ... idemmail` in an interpreter of its own
def test_a_released_copy_of_a_record_made_under_a_raw_key_claims_that_very_record(release_app: ReleaseApp) -> None:
    """Records an older release made under a caller's raw key keep it: the copy carries it marked, so the
    worker claims it as it is instead of hashing it into another key."""
    send = release_app.workerapp.send
    key = "order-14:confirmation"
    c = send.ledger.claim(ClaimRequest(key=key, task_name=send.name, fingerprint="f",
                                       payload=send.key_builder.payload(("jo@example.com", 14), {}).to_json()))
    send.ledger.park(key, c.token, {"reason": "lease_expired"})
    done = celery_cli(release_app.env, "resolve", key, "--release", "--note", "n")
    assert done.returncode == 0, done.stderr
    [message] = queued(release_app)
    assert message["headers"]["idempotency_key"] == key
    assert send.key_builder.check_seal(message["headers"], send.key_builder.payload(("jo@example.com", 14), {})) \
        is Seal.VALID


def test_the_ledger_url_is_read_through_the_settings_table(tmp_path: Path) -> None:
    """-A: the app's ledger as its workers resolve it (idemmail_* settings parsed strictly, so a value a
    loader padded still works and one that is not a URL is a usage error, not a traceback)."""
    from celery import Celery

    path = tmp_path / "ledger.sqlite3"
    led = from_url(f"sqlite:///{path}")
    parked(led, "k-settings")

    class Holder:
        app = Celery("cli-settings", set_as_current=False)

    Holder.app.conf.idemmail_ledger_url = f"  sqlite:///{path}\n"  # as an env-file loader may hand it over
    out = CliRunner().invoke(idemmail, ["ledger", "list", "--state", "review"], obj=Holder())
    assert out.exit_code == 0, out.output
    assert "k-settings" in out.output
    Holder.app.conf.idemmail_ledger_url = 42
    bad = CliRunner().invoke(idemmail, ["ledger", "list"], obj=Holder())
    assert bad.exit_code == 2 and "idemmail_ledger_url must be a string" in bad.output
    none = CliRunner().invoke(idemmail, ["ledger", "list"], obj=_Obj())
    assert none.exit_code == 2 and "no ledger" in none.output
    led.close()


def test_ledger_secrets_shows_the_roster_of_live_workers(cli_ledger: Ledger) -> None:
    assert "no live worker" in run(cli_ledger, "ledger", "secrets").output
    cli_ledger.announce("worker-a:11", ["0123456789ab"], 30.0)
    cli_ledger.announce("worker-b:22", ["ba9876543210", "0123456789ab"], 30.0)
    out = run(cli_ledger, "ledger", "secrets")
    assert out.exit_code == 0, out.output
    # Counted down from the 30 s announced; a loaded machine (CI beside make chaos) took 4 s to get here.
    lapse = re.search(r"worker-a:11\s+0123456789ab\s+lapses in (\d+) s", out.output)
    assert lapse and 15 <= int(lapse.group(1)) <= 30, out.output
    shown = json.loads(run(cli_ledger, "ledger", "secrets", "--json").output)
    assert [(w["member"], w["secret_ids"]) for w in shown["workers"]] == [
        ("worker-a:11", ["0123456789ab"]), ("worker-b:22", ["ba9876543210", "0123456789ab"])]
