"""Ledger loss: the Redis ledger's epoch markers stop every claim after a flush until a person acknowledges it.

Each test has its own key prefix on the shared Redis; "losing" the store means deleting
that prefix's keys (all of them, or one bucket's), never FLUSHDB.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from idemmail_celery.cli import EXIT_ILLEGAL, EXIT_LOST, EXIT_UNKNOWN_KEY, idemmail
from idemmail_celery.errors import LedgerLostError, LedgerUnavailableError, UnsafeLedgerError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State, from_url
from idemmail_celery.ledger.redis import LAYOUT, RedisLedger

from .conftest import REDIS_URL, service_missing, unique

ROOT = Path(__file__).resolve().parents[1]


def req(key: str, lease: float = 30.0, owner: str | None = None) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="t.send", payload='{"args":[],"kwargs":{}}', fingerprint="f" * 64,
                        lease_seconds=lease, **({"owner": owner} if owner else {}))


def open_ledger(prefix: str, url: str = REDIS_URL, **options: Any) -> RedisLedger:
    """A new RedisLedger object: what a new worker process would build."""
    led = from_url(url, prefix=prefix, **options)
    assert isinstance(led, RedisLedger)
    return led


def wipe(led: RedisLedger, bucket: int | None = None) -> int:
    """Lose the ledger's keys (or one bucket's), as a flush or an empty restart would."""
    pattern = f"{led.prefix}:*" if bucket is None else f"{led.prefix}:{{{bucket:02x}}}:*"
    names = list(led.client.scan_iter(pattern, count=1000))
    pipe = led.client.pipeline(transaction=False)
    for name in names:
        pipe.delete(name)
    pipe.execute()
    return len(names)


def names(led: RedisLedger) -> set[str]:
    return set(led.client.scan_iter(f"{led.prefix}:*", count=1000))


def cli(led: RedisLedger, *args: str) -> Any:
    kw = led.client.connection_pool.connection_kwargs
    url = f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"
    return CliRunner().invoke(idemmail, ["--ledger-url", url, "--prefix", led.prefix, *args],
                              obj=type("Obj", (), {"app": None})())


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique("loss")
    probe = open_ledger(name)
    try:
        probe.client.ping()
    except Exception as exc:
        service_missing("redis", exc)
    yield name
    wipe(probe)
    probe.close()


def key_in_bucket(led: RedisLedger, bucket: int, n: int = 0) -> str:
    """The n-th key ``k<i>`` that lands in ``bucket``."""
    found = [k for k in (f"k{i}" for i in range(10_000)) if led.names.bucket(k) == bucket]
    return found[n]


def seen_lost(prefix: str) -> RedisLedger:
    """A worker that sent ``k``, then met the store emptied (and flagged it lost)."""
    led = open_ledger(prefix)
    c = led.claim(req("k"))
    led.complete("k", c.token, {"message_id": "m"})
    wipe(led)
    with pytest.raises(LedgerLostError):
        led.claim(req("k"))
    return led


def test_claim_after_a_flush_is_refused_and_writes_nothing(prefix: str) -> None:
    led = open_ledger(prefix)
    c = led.claim(req("k"))
    led.complete("k", c.token, {"message_id": "m"})
    assert led.claim(req("k")).status is ClaimStatus.DONE
    wipe(led)
    with pytest.raises(LedgerLostError, match="lost"):
        led.claim(req("k"))
    assert not any(":r:" in n or ":i:" in n for n in names(led))  # no record, no index entry
    # The process that saw it flagged every marker: a worker starting now stops too.
    with pytest.raises(LedgerLostError, match="every epoch marker is gone"):
        open_ledger(prefix).claim(req("k"))
    assert not any(":r:" in n for n in names(led))
    assert isinstance(LedgerLostError("x"), LedgerUnavailableError)  # tasks fail closed on it


def test_finish_and_renew_on_a_lost_store_do_not_recreate_the_record(prefix: str) -> None:
    led = open_ledger(prefix)
    c = led.claim(req("k"))
    wipe(led)
    with pytest.raises(LedgerLostError):
        led.renew("k", c.token, 30)
    with pytest.raises(LedgerLostError):
        led.complete("k", c.token, {"message_id": "m"})
    with pytest.raises(LedgerLostError):
        led.park("k", c.token, {"reason": "x"})
    assert led.get("k") is None
    assert not any(":r:" in n or ":i:" in n for n in names(led))


def test_ack_loss_via_the_cli_lets_claims_through_and_forgets_the_old_intents(prefix: str) -> None:
    led = seen_lost(prefix)
    other = open_ledger(prefix)  # another worker, started after the loss
    stats = cli(led, "ledger", "stats")
    assert stats.exit_code == EXIT_LOST and "LOST" in stats.output, stats.output
    out = cli(led, "ledger", "ack-loss", "--note", "Redis restarted empty; provider log checked", "--actor", "ana")
    assert out.exit_code == 0, out.output
    assert "ana" in out.output and "forgotten" in out.output
    # Both adopt the acknowledged epoch. The old intent is forgotten: its duplicate claims afresh.
    assert led.claim(req("k")).status is ClaimStatus.ACQUIRED
    assert other.claim(req("k2")).status is ClaimStatus.ACQUIRED
    stats = cli(led, "ledger", "stats", "--json")
    assert stats.exit_code == 0, stats.output
    import json

    epoch = json.loads(stats.output)["epoch"]
    assert epoch["state"] == "ok" and epoch["acked_by"] == "ana" and "provider log" in epoch["note"]
    # Every process that adopted the acknowledged epoch knows when the loss was accepted: tasks park
    # keyless copies enqueued before it (see test_ledger_loss_worker). A store that lost nothing says None.
    acked = float(epoch["acked_at"])
    assert led.recovered_at == acked and other.recovered_at == acked
    late = open_ledger(prefix)
    late.ping()
    assert late.claim(req("k3")).status is ClaimStatus.ACQUIRED and late.recovered_at == acked
    assert open_ledger(f"{prefix}-fresh").recovered_at is None
    again = cli(led, "ledger", "ack-loss", "--note", "twice")
    assert again.exit_code == EXIT_ILLEGAL and "not lost" in again.output


def test_ack_loss_as_a_subprocess(prefix: str) -> None:
    led = open_ledger(prefix)
    led.claim(req("k"))
    wipe(led)
    with pytest.raises(LedgerLostError):
        led.claim(req("k2"))
    kw = led.client.connection_pool.connection_kwargs
    url = f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"
    done = subprocess.run(
        [sys.executable, "-m", "idemmail_celery", "--ledger-url", url, "--prefix", prefix,
         "ledger", "ack-loss", "--note", "drill"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert led.claim(req("k2")).status is ClaimStatus.ACQUIRED


def test_strict_mode_needs_init_first(prefix: str) -> None:
    strict = open_ledger(prefix, auto_init=False)
    with pytest.raises(LedgerLostError, match="not initialised"):
        strict.claim(req("k"))
    assert not names(strict)  # nothing written, not even markers
    out = cli(strict, "ledger", "init")
    assert out.exit_code == 0 and "epoch" in out.output, out.output
    assert strict.claim(req("k")).status is ClaimStatus.ACQUIRED
    assert cli(strict, "ledger", "init").exit_code == 0  # idempotent
    # Emptied while nothing ran: a strict worker starting now cannot take it for a new ledger.
    wipe(strict)
    with pytest.raises(LedgerLostError, match="not initialised"):
        open_ledger(prefix, auto_init=False).claim(req("k"))


def test_losing_one_bucket_is_detected(prefix: str) -> None:
    led = open_ledger(prefix)
    keys = [key_in_bucket(led, b) for b in range(led.buckets)]
    for k in keys:
        led.claim(req(k))
    assert wipe(led, bucket=3) >= 3  # record, index, marker
    # A worker starting now sees records elsewhere and a bucket without a marker.
    fresh = open_ledger(prefix)
    with pytest.raises(LedgerLostError, match="buckets 3 lost their epoch marker"):
        fresh.claim(req(key_in_bucket(fresh, 3, 1)))
    # A running worker is stopped in every bucket, not only the lost one: the marker flags say so.
    with pytest.raises(LedgerLostError):
        led.claim(req(key_in_bucket(led, 5, 1)))
    assert led.get(key_in_bucket(led, 5, 1)) is None


def test_losing_one_bucket_is_detected_by_the_running_worker_first(prefix: str) -> None:
    led = open_ledger(prefix)
    led.claim(req(key_in_bucket(led, 0)))
    wipe(led, bucket=7)  # only the marker lived there
    with pytest.raises(LedgerLostError, match="buckets 7"):
        led.claim(req(key_in_bucket(led, 7)))
    assert open_ledger(prefix).loss_status()["state"] == "lost"


def test_a_batch_that_meets_a_lost_bucket_hands_back_what_it_took(prefix: str) -> None:
    led = open_ledger(prefix)
    fresh, released, expired, sent, live, gone = (key_in_bucket(led, b) for b in (0, 1, 3, 4, 5, 2))
    led.claim(req(key_in_bucket(led, 2, 5)))
    c = led.claim(req(released))
    led.release(released, c.token)
    led.claim(req(expired, lease=0.05))  # its holder vanished: it may have sent
    c = led.claim(req(sent))
    led.complete(sent, c.token, {"message_id": "m"})
    live_token = led.claim(req(live, owner="other")).token
    time.sleep(0.1)
    wipe(led, bucket=2)
    with pytest.raises(LedgerLostError):
        led.claim_many([req(k) for k in (fresh, released, expired, sent, live, gone)])
    # Nothing was sent under what the batch took: acquired and reopened claims are handed back.
    for k in (fresh, released):
        record = led.get(k)
        assert record is not None and record.state is State.RELEASED, (k, record)
        assert record.error is not None and record.error["reason"] == "batch_met_lost_ledger"
    # A reclaimed claim is not released (the next claim would reopen it and send): it stays
    # claimed, its lease ended, for the next claim to reclaim and the reclaim rules to decide.
    record = led.get(expired)
    assert record is not None and record.state is State.CLAIMED and record.reclaims == 1, record
    assert record.lease_expires_at is not None and record.lease_expires_at <= time.time()
    assert (r := led.get(sent)) is not None and r.state is State.SENT
    assert (r := led.get(live)) is not None and r.state is State.CLAIMED and r.token == live_token
    assert r.owner == "other" and (r.lease_expires_at or 0) > time.time()
    assert led.get(gone) is None
    # After the acknowledgement the next claims see the same thing.
    open_ledger(prefix).acknowledge_loss(note="bucket 2 lost", actor="test")
    assert led.claim(req(expired)).status is ClaimStatus.RECLAIMED
    assert led.claim(req(fresh)).status is ClaimStatus.REOPENED
    assert led.claim(req(sent)).status is ClaimStatus.DONE
    assert led.claim(req(gone)).status is ClaimStatus.ACQUIRED


def test_a_process_that_saw_the_loss_remembers_it_when_the_store_is_emptied_again(prefix: str) -> None:
    led = seen_lost(prefix)
    assert open_ledger(prefix).loss_status()["state"] == "lost"
    wipe(led)  # an empty restart again: the lost flags go with everything else, the store looks new
    with pytest.raises(LedgerLostError, match="every epoch marker is gone"):
        led.claim(req("k"))
    with pytest.raises(LedgerLostError):
        led.claim_many([req("k"), req("k2")])
    assert not any(":r:" in n or ":i:" in n for n in names(led))
    assert open_ledger(prefix).loss_status()["state"] == "lost"  # flagged again: others stop too
    open_ledger(prefix).acknowledge_loss(note="emptied twice; checked", actor="test")
    assert led.claim(req("k")).status is ClaimStatus.ACQUIRED  # an operator decided


def test_a_process_that_saw_the_loss_refuses_an_unacknowledged_fresh_epoch(prefix: str) -> None:
    led = seen_lost(prefix)
    wipe(led)
    fresh = open_ledger(prefix)  # started after the second emptying: the documented limit
    assert fresh.claim(req("b")).status is ClaimStatus.ACQUIRED
    with pytest.raises(LedgerLostError):
        led.claim(req("k"))
    with pytest.raises(LedgerLostError):
        fresh.claim(req("c"))
    assert led.get("k") is None


def test_read_only_cli_commands_never_start_an_epoch_on_an_emptied_store(prefix: str) -> None:
    strict = open_ledger(prefix, auto_init=False)
    assert cli(strict, "ledger", "init").exit_code == 0
    c = strict.claim(req("k"))
    strict.complete("k", c.token, {"message_id": "m"})
    wipe(strict)  # emptied while no worker ran
    stats = cli(strict, "ledger", "stats", "--json")
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output)["epoch"]["state"] == "new"
    assert cli(strict, "ledger", "stats").exit_code == 0
    listed = cli(strict, "ledger", "list")
    assert listed.exit_code == 0 and listed.output == "", listed.output
    assert cli(strict, "ledger", "show", "k").exit_code == EXIT_UNKNOWN_KEY
    assert cli(strict, "ledger", "purge", "--expired").exit_code == 0
    assert not names(strict), names(strict)  # not a marker written
    with pytest.raises(LedgerLostError, match="not initialised"):
        open_ledger(prefix, auto_init=False).claim(req("k"))
    # The same as the reviewer ran it: a separate process.
    kw = strict.client.connection_pool.connection_kwargs
    url = f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}"
    done = subprocess.run([sys.executable, "-m", "idemmail_celery", "--ledger-url", url, "--prefix", prefix,
                           "ledger", "stats"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "none yet" in done.stdout, (done.stdout, done.stderr)
    assert not names(strict)
    with pytest.raises(LedgerLostError, match="not initialised"):
        open_ledger(prefix, auto_init=False).claim(req("k"))


def test_read_only_cli_commands_on_a_lost_store_report_and_write_no_flag(prefix: str) -> None:
    led = open_ledger(prefix)
    kept = key_in_bucket(led, 0)
    for k in (kept, key_in_bucket(led, 3)):
        c = led.claim(req(k))
        led.complete(k, c.token, {"message_id": "m"})
    wipe(led, bucket=3)
    markers = {led.names.marker(b) for b in range(led.buckets)}
    before = {n: led.client.hgetall(n) for n in names(led) if n in markers}
    stats = cli(led, "ledger", "stats")
    assert stats.exit_code == EXIT_LOST and "buckets 3 lost" in stats.output, stats.output
    listed = cli(led, "ledger", "list", "--state", "sent")
    assert listed.exit_code == 0 and kept in listed.output, listed.output
    shown = cli(led, "ledger", "show", kept)
    assert shown.exit_code == 0 and json.loads(shown.output)["state"] == "sent", shown.output
    after = {n: led.client.hgetall(n) for n in names(led) if n in markers}
    assert after == before  # no lost flag: a look is not a decision
    assert not any(m.get("lost") for m in after.values())


def test_the_metrics_scrape_never_starts_an_epoch(prefix: str) -> None:
    from idemmail_celery.metrics import RecordsCollector
    from idemmail_celery.outcomes import app_ledger

    strict = open_ledger(prefix, auto_init=False)
    app = type("App", (), {"conf": {"idemmail_ledger_url": REDIS_URL,
                                    "idemmail_ledger_options": {"prefix": prefix, "auto_init": False}}})()
    counts = RecordsCollector(app_ledger(app), ttl=0).counts()
    assert counts == {"claimed": 0, "released": 0, "review": 0}, counts  # read, and reported
    assert not names(strict)
    # Also with auto_init on (the default): a scrape is not a worker.
    app.conf["idemmail_ledger_options"] = {"prefix": prefix}
    assert RecordsCollector(app_ledger(app), ttl=0).counts() is not None
    assert not names(strict)
    with pytest.raises(LedgerLostError, match="not initialised"):
        strict.claim(req("k"))


def test_a_store_whose_markers_name_another_record_layout_is_refused(prefix: str) -> None:
    """The markers carry the record layout's format version (1): a store they say was written in another (a later
    release's, or markers without a version) is refused at first use, by a worker, a strict one and `ledger
    init`, and nothing is flagged over it; with this version's markers back, it works."""
    led = open_ledger(prefix)
    led.prepare()
    markers = [led.names.marker(b) for b in range(led.buckets)]
    assert {led.client.hget(name, "layout") for name in markers} == {LAYOUT} == {"1"}
    for name in markers:
        led.client.hset(name, "layout", "2")
    with pytest.raises(UnsafeLedgerError, match=r"written in record layout 2; this version reads layout 1 only"):
        open_ledger(prefix).claim(req("k"))
    with pytest.raises(UnsafeLedgerError, match="record layout 2"):
        open_ledger(prefix, auto_init=False).claim(req("k"))
    out = cli(led, "ledger", "init")
    assert out.exit_code != 0 and "record layout 2" in out.output, out.output
    led.client.hdel(markers[0], "layout")
    with pytest.raises(UnsafeLedgerError, match="record layout 2/unknown"):
        open_ledger(prefix).claim(req("k"))
    assert not any(led.client.hget(name, "lost") for name in markers)  # refused: no loss flagged
    for name in markers:
        led.client.hset(name, "layout", LAYOUT)
    assert open_ledger(prefix).claim(req("k")).status is ClaimStatus.ACQUIRED


def test_a_worker_that_started_afresh_after_the_flush_is_stopped_by_one_that_held_the_epoch(prefix: str) -> None:
    # The documented limit: a process that finds the store empty cannot tell it from a new one
    # (without auto_init=False) and starts a new epoch. The first worker that held the old
    # epoch sees it change without an acknowledgement and stops everyone.
    old = open_ledger(prefix)
    old.claim(req("a"))
    wipe(old)
    fresh = open_ledger(prefix)
    assert fresh.claim(req("b")).status is ClaimStatus.ACQUIRED  # the limit, shown
    with pytest.raises(LedgerLostError, match="without an acknowledgement"):
        old.claim(req("a"))
    with pytest.raises(LedgerLostError):
        fresh.claim(req("c"))


def test_new_ledger_started_by_many_workers_at_once_gets_one_epoch(prefix: str) -> None:
    ledgers = [open_ledger(prefix) for _ in range(8)]
    start = threading.Barrier(len(ledgers))
    errors: list[BaseException] = []

    def go(i: int, led: RedisLedger) -> None:
        start.wait()
        try:
            led.claim(req(f"n{i}"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i, led)) for i, led in enumerate(ledgers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    status = ledgers[0].loss_status()
    assert status["state"] == "ok"
    assert {led._epoch for led in ledgers} == {status["epoch"]}


def test_another_bucket_count_is_refused(prefix: str) -> None:
    open_ledger(prefix).claim(req("k"))
    with pytest.raises(UnsafeLedgerError, match="buckets"):
        open_ledger(prefix, buckets=32).claim(req("k"))


def test_the_cli_finds_the_loss_markers_behind_the_sealed_wrapper(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With payload keys the CLI's ledger is a SealedLedger around the Redis one: ``stats`` must still
    see the loss (exit 5) and ``ack-loss`` still end it. Since Python 3.12 a runtime-checkable protocol
    no longer sees methods a wrapper forwards, so the capability is asked of ``ledger.backend``."""
    from cryptography.fernet import Fernet

    from idemmail_celery.cli import _markers
    from idemmail_celery.ledger import DetectsLoss
    from idemmail_celery.ledger.metered import MeteredLedger
    from idemmail_celery.ledger.sealed import PayloadCodec, SealedLedger

    led = seen_lost(prefix)
    wrapped = MeteredLedger(SealedLedger(led, PayloadCodec([Fernet.generate_key().decode()])))
    assert wrapped.backend is led and _markers(wrapped) is led and isinstance(_markers(wrapped), DetectsLoss)
    monkeypatch.setenv("IDEMMAIL_PAYLOAD_KEYS", Fernet.generate_key().decode())
    stats = cli(led, "ledger", "stats")
    assert stats.exit_code == EXIT_LOST and "LOST" in stats.output, stats.output
    out = cli(led, "ledger", "ack-loss", "--note", "restarted empty", "--actor", "ana")
    assert out.exit_code == 0, out.output
    assert led.claim(req("k")).status is ClaimStatus.ACQUIRED
