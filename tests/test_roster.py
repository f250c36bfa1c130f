"""One-step key-secret rotation (issue 35, item 4): keys and seals follow the roster of live workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from idemmail_celery import IdempotentTask, roster
from idemmail_celery.chain import KEY_HEADER, KEY_MARK_HEADER, OLDER_KEYS_HEADER
from idemmail_celery.keys import secret_ids
from idemmail_celery.ledger.base import RosterEntry

from .conftest import unique, wait_for

OLD, NEW = b"old-secret", b"new-secret"
OLD_ID, NEW_ID = secret_ids([OLD, NEW])


def entry(*ids: str) -> RosterEntry:
    return RosterEntry(unique("w"), ids, 0.0)


def test_the_newest_secret_every_live_worker_holds_comes_first() -> None:
    both = (NEW, OLD)
    assert roster.active_order(both, [entry(OLD_ID), entry(NEW_ID, OLD_ID)]) == (OLD, NEW)  # one still on [old]
    assert roster.active_order(both, [entry(NEW_ID, OLD_ID), entry(NEW_ID, OLD_ID)]) == (NEW, OLD)
    assert roster.active_order(both, []) == (NEW, OLD)  # no live worker: nobody to wait for
    assert roster.active_order(both, None) == (OLD, NEW)  # no roster: the oldest, which everyone holds
    assert roster.active_order((NEW, OLD, None), [entry(OLD_ID, "plain"), entry(NEW_ID, OLD_ID)]) == (OLD, NEW, None)
    assert roster.active_order((NEW,), None) == (NEW,)


def sender(tmp_path: Path, secrets: list[bytes], name: str = "tests.roster.send") -> Any:
    app = Celery(unique("roster"), set_as_current=False)
    app.conf.update(idemmail_ledger_url=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", idemmail_key_secret=secrets)

    @app.task(base=IdempotentTask, name=name, shared=False, idempotency_key=("to",))
    def send(to: str) -> dict[str, Any]:
        return {"message_id": "m"}

    return send


def test_a_caller_on_new_old_makes_keys_under_old_while_a_worker_without_new_is_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_only, upgraded = sender(tmp_path, [OLD]), sender(tmp_path, [NEW, OLD])
    ledger = upgraded.ledger
    reads: list[int] = []
    real_roster = ledger.backend.roster
    monkeypatch.setattr(ledger.backend, "roster", lambda: reads.append(1) or real_roster())
    ledger.announce("old-worker:1", [OLD_ID], 30.0)
    ledger.announce("new-worker:2", [NEW_ID, OLD_ID], 30.0)
    under_old = old_only.key_builder.derive(old_only.key_builder.payload(("ann@example.com",), {}))
    for _ in range(50):
        headers = upgraded.intent_headers(("ann@example.com",), {})
    assert headers[KEY_HEADER] == under_old  # the key the [old] worker finds
    assert headers[KEY_MARK_HEADER].startswith(f"{OLD_ID}:")  # a seal the [old] worker can check
    assert len(headers[OLDER_KEYS_HEADER]) == 1 and headers[OLDER_KEYS_HEADER][0] != under_old
    assert len(reads) == 1  # the roster is read once, not per enqueue

    ledger.announce("old-worker:1", [OLD_ID], 0)  # the last worker without `new` is gone
    monkeypatch.setattr(roster, "REFRESH_SECONDS", 0.0)
    headers = upgraded.intent_headers(("ann@example.com",), {})
    assert headers[KEY_HEADER] != under_old and headers[OLDER_KEYS_HEADER] == [under_old]
    assert headers[KEY_MARK_HEADER].startswith(f"{NEW_ID}:")


def test_a_worker_announces_the_secrets_all_its_tasks_hold_and_leaves_at_shutdown(tmp_path: Path) -> None:
    from idemmail_celery.worker import announcer

    send = sender(tmp_path, [NEW, OLD])
    beat = announcer(send.app).start()
    try:
        wait_for(beat.landed, timeout=10)
        [mine] = [e for e in send.ledger.roster() if e.member == beat.member]
        assert mine.secret_ids == (NEW_ID, OLD_ID)
    finally:
        beat.stop()
    assert [e for e in send.ledger.roster() if e.member == beat.member] == []


def test_a_ledger_without_a_roster_keeps_the_configured_order_and_an_unreadable_one_the_oldest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idemmail_celery.errors import LedgerUnavailableError

    ledger = sender(tmp_path, [NEW, OLD]).ledger

    def missing() -> list[RosterEntry]:
        raise NotImplementedError("no roster here")

    def down() -> list[RosterEntry]:
        raise LedgerUnavailableError("down")

    monkeypatch.setattr(ledger.backend, "roster", missing)
    assert roster.RosterView(ledger).order((NEW, OLD)) == (NEW, OLD)  # rotate in two deploys there
    monkeypatch.setattr(ledger.backend, "roster", down)
    assert roster.RosterView(ledger).order((NEW, OLD)) == (OLD, NEW)


def test_the_first_announcement_holds_no_start_up_and_a_claim_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The heartbeat starts without waiting on the ledger (a worker used to block in ``worker_init`` for as long
    as its first announcement took); until one lands, ``ensure`` announces in the caller and raises what the
    ledger raises, so a delivery claims nothing before the roster holds its worker."""
    import threading

    from idemmail_celery.errors import LedgerUnavailableError
    from idemmail_celery.worker import announcer

    send = sender(tmp_path, [NEW, OLD])
    ledger = send.ledger
    gate, calls = threading.Event(), []
    real_announce = ledger.backend.announce

    def slow_then_down(member: str, ids: Any, ttl: float) -> None:
        calls.append(threading.current_thread().name)
        if not gate.wait(5):
            raise LedgerUnavailableError("down")
        real_announce(member, ids, ttl)

    monkeypatch.setattr(ledger.backend, "announce", slow_then_down)
    monkeypatch.setattr(roster, "FIRST_RETRY_SECONDS", 0.05)
    beat = announcer(send.app)
    try:
        beat.start()  # returns at once, the ledger stalling
        assert not beat.landed()
        with pytest.raises(LedgerUnavailableError):
            beat.ensure(ledger)  # the delivery's own try, in its thread: the ledger does not answer
        assert "MainThread" in calls and not beat.landed()
        gate.set()  # the ledger answers
        beat.ensure(ledger)
        assert beat.landed() and [e.member for e in ledger.roster()] == [beat.member]
        made = len(calls)
        beat.ensure(ledger)  # landed: no more round trips per claim
        assert len(calls) == made
    finally:
        gate.set()
        beat.stop()


def test_a_worker_makes_no_key_before_a_roster_read_has_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make chaos`` (campaign-blips-rotate, 2026-11-29) found it: a worker in the first step of a two-step rotation
    (``[old, new]``) whose first roster read failed (the ledger just back from an outage) took the last secret,
    ``new``, for its keys while a worker still on ``[old]`` ran: 23 recipients were sent under both keys. A worker
    now reads the roster before it makes a key (``ensure_announced``), and its delivery waits while it cannot."""
    from idemmail_celery.errors import LedgerUnavailableError
    from idemmail_celery.worker import announcer

    send = sender(tmp_path, [OLD, NEW])  # step 1 of two: keys under `old`, records under `new` found
    ledger = send.ledger
    ledger.announce("old-worker:1", [OLD_ID], 30.0)  # a worker not redeployed yet
    real_roster, reads = ledger.backend.roster, []

    def down() -> list[RosterEntry]:
        reads.append("down")
        raise LedgerUnavailableError("down")

    monkeypatch.setattr(ledger.backend, "roster", down)
    beat = announcer(send.app)
    beat.ensure(ledger)  # this worker's own entry landed: the announcement is not the read
    monkeypatch.setitem(roster.running, id(send.app), beat)
    try:
        # What an unread roster gives (the last secret): a key no worker on [old] can find.
        guessed = send.key_builder.derive(send.key_builder.payload(("ann@example.com",), {}))
        with pytest.raises(LedgerUnavailableError, match="roster could not be read"):
            send.ensure_announced()
        assert len(reads) == 2  # the cached failed read was not taken for an answer: read again, at once
        monkeypatch.setattr(ledger.backend, "roster", real_roster)
        send.ensure_announced()  # the ledger answers: read now, not after the refresh interval
        made = send.key_builder.derive(send.key_builder.payload(("ann@example.com",), {}))
        old_only = sender(tmp_path, [OLD])
        assert made == old_only.key_builder.derive(old_only.key_builder.payload(("ann@example.com",), {}))
        assert made != guessed
        send.ensure_announced()  # read once: no round trip per delivery
        assert len(reads) == 2
    finally:
        beat.stop()
