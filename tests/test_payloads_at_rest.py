"""Payloads at rest on every real backend: sealed with Fernet, rotated, erased, and never stored plain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from click.testing import CliRunner
from cryptography.fernet import Fernet

from idemmail_celery import ConfigurationError
from idemmail_celery.cli import EXIT_PAYLOAD_KEY, EXIT_UNKNOWN_KEY, idemmail
from idemmail_celery.config import Settings
from idemmail_celery.errors import PayloadKeyError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State, from_url
from idemmail_celery.ledger.redis import RedisLedger, _pack_fp
from idemmail_celery.ledger.sealed import PAYLOAD_KEY_UNKNOWN, SEALED_PREFIX, SealedLedger
from idemmail_celery.ledger.sql import SQLLedger

from .conftest import BACKENDS, drop_ledger, make_ledger

ROOT = Path(__file__).resolve().parents[1]
OLD, NEW, STRANGER = (Fernet.generate_key().decode() for _ in range(3))
ADDRESS = "ann.personal@example.com"
FIRST = json.dumps({"args": [], "kwargs": {"to": ADDRESS, "text": "Your order 4821"}}, separators=(",", ":"))


def req(key: str, payload: str = FIRST) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="tests.send", payload=payload, fingerprint="f" * 64, lease_seconds=30)


def sibling(ledger: Ledger, keys: list[str] | None) -> Ledger:
    """Another ledger on the same store and namespace, with other payload keys (None: no encryption)."""
    inner = ledger.inner if isinstance(ledger, SealedLedger) else ledger
    options: dict[str, Any] = {"payload_keys": keys} if keys else {}
    if isinstance(inner, RedisLedger):
        kw = inner.client.connection_pool.connection_kwargs
        return from_url(f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}", prefix=inner.prefix, **options)
    assert isinstance(inner, SQLLedger)
    return from_url(inner.url.render_as_string(hide_password=False), table=inner.table.name, **options)


def raw_store(ledger: Ledger) -> str:
    """Everything the store holds for this ledger's namespace, read directly (HGETALL, SELECT)."""
    inner = ledger.inner if isinstance(ledger, SealedLedger) else ledger
    if isinstance(inner, RedisLedger):
        r = inner.client
        out = []
        raw = redis.Redis(connection_pool=redis.ConnectionPool(**{  # the same server, not decoding
            **r.connection_pool.connection_kwargs, "decode_responses": False}))
        for name in r.scan_iter(f"*{inner.prefix}*", count=1000):
            if r.type(name) == "hash" and ":d:" in name:  # a shelf of sent records: binary fields and fingerprints
                out.append(json.dumps({k.hex(): v.decode("latin-1") for k, v in raw.hgetall(name).items()}))
            elif r.type(name) == "hash":
                out.append(json.dumps(r.hgetall(name)))
            elif r.type(name) == "zset":
                out.append(json.dumps(r.zrange(name, 0, -1)))
            elif r.type(name) == "string":
                out.append(str(r.get(name)))
        return "\n".join(out)
    assert isinstance(inner, SQLLedger)
    with inner.engine.connect() as conn:
        return "\n".join(repr(tuple(row)) for row in conn.execute(sa.select(inner.table)))


def raw_record(ledger: Ledger, key: str) -> str:
    """One record as the store holds it (HGETALL of its hash, or its row)."""
    inner = ledger.inner if isinstance(ledger, SealedLedger) else ledger
    if isinstance(inner, RedisLedger):  # the hash, and the first payload's own string key
        names = inner.names
        return json.dumps({**inner.client.hgetall(names.record(key)), "payload": inner.client.get(names.payload(key))})
    assert isinstance(inner, SQLLedger)
    with inner.engine.connect() as conn:
        row = conn.execute(sa.select(inner.table).where(inner.table.c.intent_key == key)).one()
    return repr(tuple(row))


@pytest.fixture(params=BACKENDS)
def sealed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    led = make_ledger(request.param, tmp_path_factory, payload_keys=[NEW, OLD])
    assert isinstance(led, SealedLedger)
    yield led
    drop_ledger(led.inner)


def test_sealed_payload_round_trips_through_claim_release_reclaim_complete(sealed: Ledger) -> None:
    first = sealed.claim(req("rt"))
    assert first.status is ClaimStatus.ACQUIRED and first.record.payload == FIRST
    assert sealed.claim(req("rt", payload="{}")).record.payload == FIRST  # busy: opened for must-match checks
    sealed.release("rt", first.token, {"reason": "connect", "message": f"refused for {ADDRESS}"})
    record = sealed.get("rt")
    assert record is not None and record.payload == FIRST
    assert record.error == {"reason": "connect", "message": f"refused for {ADDRESS}"}
    again = sealed.claim(req("rt", payload='{"args":[],"kwargs":{"to":"rewritten@example.com"}}'))
    assert again.status is ClaimStatus.REOPENED and again.record.payload == FIRST  # the first payload ships
    sealed.complete("rt", again.token, {"value": {"accepted": ADDRESS}, "message_id": "m-1"})
    done = sealed.get("rt")
    assert done is not None and done.state is State.SENT and done.payload is None  # erased on sent
    assert done.result == {"value": {"accepted": ADDRESS}, "message_id": "m-1"}
    dup = sealed.claim(req("rt"))
    assert dup.status is ClaimStatus.DONE and dup.record.result == done.result
    assert [r.key for r in sealed.iter_records(State.SENT)] == ["rt"]
    assert sealed.stats()["sent"] == 1


def test_the_store_holds_no_plaintext_payload_result_or_error(sealed: Ledger) -> None:
    c = sealed.claim(req("raw-released"))
    sealed.release("raw-released", c.token, {"reason": "connect", "message": f"550 <{ADDRESS}> greylisted"})
    d = sealed.claim(req("raw-sent"))
    sealed.complete("raw-sent", d.token, {"value": {"to": ADDRESS}, "message_id": "<m-2>"})
    p = sealed.claim(req("raw-review"))
    sealed.park("raw-review", p.token, {"reason": "timeout", "message": f"timeout sending to {ADDRESS}"})
    sealed.resolve("raw-review", "sent", result={"message_id": "<found>", "to": ADDRESS}, note="seen", actor="ops")
    stored = raw_store(sealed)
    fingerprint = (json.dumps(_pack_fp("f" * 64))[1:-1] if isinstance(sealed.inner, RedisLedger)  # type: ignore[attr-defined]
                   else "f" * 64)
    assert "raw-released" in stored and fingerprint in stored  # keys and fingerprints stay plain (hashes)
    assert SEALED_PREFIX in stored and "$fernet" in stored
    # Each with a character base64url never has, so no ciphertext can hold one by chance.
    for secret in (ADDRESS, "Your order", "greylisted", "<m-2>", "<found>"):
        assert secret not in stored, secret


def test_rotation_new_key_first_old_records_still_open(sealed: Ledger) -> None:
    before = sibling(sealed, [OLD])  # the deployment before rotation
    c = before.claim(req("rot"))
    before.release("rot", c.token, {"reason": "connect"})
    p = before.claim(req("rot-review"))
    before.park("rot-review", p.token, {"reason": "ambiguous"})
    # After rotation ([NEW, OLD]): old records open, new writes are sealed with NEW.
    record = sealed.get("rot")
    assert record is not None and record.payload == FIRST and record.error == {"reason": "connect"}
    again = sealed.claim(req("rot"))
    assert again.status is ClaimStatus.REOPENED and again.record.payload == FIRST
    sealed.complete("rot", again.token, {"message_id": "m-3"})
    n = sealed.claim(req("rot-new"))
    sealed.release("rot-new", n.token, {"reason": "connect"})
    only_new = sibling(sealed, [NEW])
    fresh = only_new.get("rot-new")  # written after rotation: NEW alone opens it
    assert fresh is not None and fresh.payload == FIRST and fresh.error == {"reason": "connect"}
    # Records written before rotation keep fields sealed with OLD (here the release note of a
    # record now sent, and a review record) until they expire or are resolved: OLD stays until then.
    for key in ("rot", "rot-review"):
        with pytest.raises(PayloadKeyError):
            only_new.get(key)
    assert [r.key for r in only_new.iter_records(State.REVIEW)] == ["rot-review"]  # listed, still sealed


def test_record_sealed_with_a_removed_key_is_parked_not_run(sealed: Ledger) -> None:
    for key in ("gone", "gone-batch", "gone-sent"):
        c = sealed.claim(req(key))
        if key == "gone-sent":
            sealed.complete(key, c.token, {"message_id": "m-4"})
        else:
            sealed.release(key, c.token, {"reason": "connect"})
    stranger = sibling(sealed, [STRANGER])
    with pytest.raises(PayloadKeyError):
        stranger.get("gone")
    with pytest.raises(PayloadKeyError, match="parked for review"):
        stranger.claim(req("gone"))
    parked = sealed.get("gone")
    assert parked is not None and parked.state is State.REVIEW
    assert parked.error is not None and parked.error["reason"] == PAYLOAD_KEY_UNKNOWN
    assert parked.payload == FIRST  # kept: with the key back, an operator releases it and it ships
    with pytest.raises(PayloadKeyError):
        stranger.claim(req("gone-sent"))  # a duplicate cannot replay what it cannot read
    # A batch never fails for one unreadable record.
    batch = stranger.claim_many([req("gone-batch"), req("fresh")])
    assert [c.status for c in batch] == [ClaimStatus.DONE, ClaimStatus.ACQUIRED]
    assert batch[0].record.state is State.REVIEW and batch[0].record.payload is None
    sealed.resolve("gone", "released", note="key restored", actor="ops")
    back = sealed.claim(req("gone"))
    assert back.status is ClaimStatus.REOPENED and back.record.payload == FIRST


def test_plaintext_records_from_before_encryption_still_read(sealed: Ledger) -> None:
    plain = sibling(sealed, None)
    c = plain.claim(req("legacy"))
    plain.release("legacy", c.token, {"reason": "connect"})
    d = plain.claim(req("legacy-sent"))
    plain.complete("legacy-sent", d.token, {"message_id": "m-5"})
    record = sealed.get("legacy")
    assert record is not None and record.payload == FIRST and record.error == {"reason": "connect"}
    assert sealed.claim(req("legacy-sent")).record.result == {"message_id": "m-5"}
    again = sealed.claim(req("legacy"))
    assert again.status is ClaimStatus.REOPENED and again.record.payload == FIRST
    sealed.complete("legacy", again.token, {"message_id": "<m-6>"})
    assert "<m-6>" not in raw_store(sealed)  # sealed, written after encryption was on (no base64 has "<")


def test_plain_first_opens_sealed_records_and_writes_plaintext(sealed: Ledger) -> None:
    c = sealed.claim(req("staged"))
    sealed.release("staged", c.token, {"reason": "connect"})
    staged = sibling(sealed, ["plain", NEW])  # the step before turning encryption on, or off
    again = staged.claim(req("staged"))
    assert again.status is ClaimStatus.REOPENED and again.record.payload == FIRST
    d = staged.claim(req("staged-plain"))
    staged.complete("staged-plain", d.token, {"message_id": "m-plain"})
    assert "m-plain" in raw_store(sealed)  # written plain
    assert sealed.claim(req("staged-plain")).record.result == {"message_id": "m-plain"}
    with pytest.raises(ConfigurationError, match="names no key"):
        sibling(sealed, ["plain"])


def test_forget_erases_a_sealed_payload_and_is_idempotent(sealed: Ledger) -> None:
    c = sealed.claim(req("forget"))
    sealed.park("forget", c.token, {"reason": "ambiguous"})
    assert sealed.forget("forget") is True
    record = sealed.get("forget")
    assert record is not None and record.payload is None and record.state is State.REVIEW
    stored = raw_record(sealed, "forget")
    assert '"s": "review"' in stored or "'review'" in stored  # the record itself, read from the store
    assert SEALED_PREFIX not in stored
    assert sealed.forget("forget") is True  # nothing left to erase: still fine
    assert sealed.forget("never-seen") is False
    assert sibling(sealed, [STRANGER]).forget("forget") is True  # erasing needs no key


def cli(ledger: Ledger, *args: str, env: dict[str, str] | None = None) -> Any:
    inner = ledger.inner if isinstance(ledger, SealedLedger) else ledger
    if isinstance(inner, RedisLedger):
        kw = inner.client.connection_pool.connection_kwargs
        where = ["--ledger-url", f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}", "--prefix", inner.prefix]
    else:
        assert isinstance(inner, SQLLedger)
        where = ["--ledger-url", inner.url.render_as_string(hide_password=False), "--table", inner.table.name]
    holder = type("Obj", (), {"app": None})()
    return CliRunner().invoke(idemmail, [*where, *args], obj=holder, env=env or {})


@pytest.mark.parametrize("backend", ["redis", "postgresql"])
def test_cli_forget_after_sent_says_nothing_to_erase_and_show_opens(
    backend: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    led = make_ledger(backend, tmp_path_factory, payload_keys=[NEW])
    try:
        keys = {"IDEMMAIL_PAYLOAD_KEYS": f"{NEW},{OLD}"}
        c = led.claim(req("cli-review"))
        led.park("cli-review", c.token, {"reason": "ambiguous"})
        shown = cli(led, "ledger", "show", "cli-review", "--payload", env=keys)
        assert shown.exit_code == 0, shown.output
        assert json.loads(shown.output)["payload"]["kwargs"]["to"] == ADDRESS
        out = cli(led, "ledger", "forget", "cli-review", env=keys)
        assert out.exit_code == 0 and "payload erased" in out.output
        d = led.claim(req("cli-sent"))
        led.complete("cli-sent", d.token, {"message_id": "m"})
        for key in ("cli-sent", "cli-review"):  # erased on sent; forgotten already
            again = cli(led, "ledger", "forget", key, env=keys)
            assert again.exit_code == 0 and "nothing to erase" in again.output, again.output
        # Without the keys, erasure still works (it needs none).
        e = led.claim(req("cli-nokey"))
        led.release("cli-nokey", e.token)
        blind = cli(led, "ledger", "forget", "cli-nokey", env={"IDEMMAIL_PAYLOAD_KEYS": ""})
        assert blind.exit_code == 0 and "payload erased" in blind.output, blind.output
        assert cli(led, "ledger", "forget", "nope", env=keys).exit_code == EXIT_UNKNOWN_KEY
        stats = cli(led, "ledger", "stats", env=keys)  # the backend's own extras reach through the wrapper
        assert stats.exit_code == 0 and ("epoch" in stats.output) is (backend == "redis"), stats.output
    finally:
        drop_ledger(led.inner)  # type: ignore[attr-defined]


def test_cli_show_without_the_sealing_key_exits_6_without_a_traceback(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    led = make_ledger("redis", tmp_path_factory, payload_keys=[NEW])
    try:
        c = led.claim(req("cli-stranger"))
        led.park("cli-stranger", c.token, {"reason": "ambiguous"})
        out = cli(led, "ledger", "show", "cli-stranger", "--payload", env={"IDEMMAIL_PAYLOAD_KEYS": OLD})
        assert out.exit_code == EXIT_PAYLOAD_KEY, out.output
        assert "idemmail_payload_keys" in out.output and "Traceback" not in out.output
        assert NEW not in out.output and OLD not in out.output  # keys never printed
    finally:
        drop_ledger(led.inner)  # type: ignore[attr-defined]


def test_settings_read_keys_from_conf_or_env_and_never_show_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMMAIL_PAYLOAD_KEYS", f" {NEW} ,{OLD},")
    s = Settings.resolve({}, None)
    assert s.payload_keys == (NEW, OLD) and NEW not in repr(s)
    assert s.ledger_kwargs()["payload_keys"] == [NEW, OLD] and s.ledger_kwargs()["keep_payload"] is False
    s2 = Settings.resolve({"idemmail_payload_keys": [OLD], "idemmail_keep_payload": True}, None)
    assert s2.payload_keys == (OLD,) and s2.ledger_kwargs()["keep_payload"] is True
    monkeypatch.delenv("IDEMMAIL_PAYLOAD_KEYS")
    assert "payload_keys" not in Settings.resolve({}, None).ledger_kwargs()
    assert type(from_url("sqlite://")) is SQLLedger  # off: the backend itself, nothing in between
    with pytest.raises(ConfigurationError, match="key 2 of 2 is not a Fernet key") as err:
        Settings.resolve({"idemmail_payload_keys": [NEW, "not-a-key-but-secret"]}, None)
    assert "not-a-key-but-secret" not in str(err.value)


def test_keys_without_cryptography_installed_fail_at_startup_with_install_hint() -> None:
    # A real interpreter in which importing cryptography fails, as on a machine without the extra.
    code = (
        "import sys; sys.modules['cryptography'] = None\n"
        "from idemmail_celery import ConfigurationError\n"
        "from idemmail_celery.config import Settings\n"
        "try:\n"
        f"    Settings.resolve({{'idemmail_payload_keys': ['{NEW}']}}, None)\n"
        "except ConfigurationError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "refused:" in out.stdout and "idemmail-celery[crypto]" in out.stdout, out.stdout + out.stderr
