"""The shipped migration scripts match the tables the ledger creates, and apply cleanly."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import pytest
import sqlalchemy as sa

from idemmail_celery.errors import ConfigurationError, LedgerUnavailableError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State, from_url
from idemmail_celery.ledger.listing import RecordQuery
from idemmail_celery.ledger.sql import MIGRATIONS, SQLLedger, migrate, migration_file, schema_sql

from .conftest import MARIADB_URL, POSTGRES_URL, service_missing

MIGRATIONS_DIR = Path(__file__).resolve().parents[1] / "idemmail_celery" / "ledger" / "migrations"
STEPS = range(1, len(MIGRATIONS) + 1)
DIALECTS = [("postgresql", POSTGRES_URL), ("mysql", MARIADB_URL), ("sqlite", None)]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("dialect", ["postgresql", "mysql", "sqlite"])
def test_shipped_migration_matches_table_definition(dialect: str, step: int) -> None:
    assert (MIGRATIONS_DIR / migration_file(dialect, step)).read_text() == schema_sql(dialect, step=step)


def test_every_shipped_file_is_a_known_step() -> None:
    shipped = sorted(p.name for p in MIGRATIONS_DIR.glob("*.sql"))
    assert shipped == sorted(migration_file(d, s) for d in ("postgresql", "mysql", "sqlite") for s in STEPS)


def _apply(url: str, dialect: str, table: str, steps: Iterable[int]) -> sa.Engine:
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for step in steps:
                for statement in schema_sql(dialect, table, step=step).split(";"):
                    body = "\n".join(ln for ln in statement.splitlines() if not ln.startswith("--")).strip()
                    if body:
                        conn.execute(sa.text(body))
    except sa.exc.OperationalError as exc:
        service_missing(dialect, exc)
    return engine


def _table_name(tmp_path: Path) -> str:
    return f"mig_{tmp_path.name[-12:].replace('-', '_')}"


@pytest.mark.parametrize("dialect,url", DIALECTS)
def test_migration_applies_and_ledger_uses_it(dialect: str, url: str | None, tmp_path: Path) -> None:
    url = url or f"sqlite:///{tmp_path / 'm.sqlite3'}"
    table = _table_name(tmp_path)
    engine = _apply(url, dialect, table, STEPS)
    ledger = from_url(url, table=table, create_table=False)
    try:
        assert ledger.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f")).status \
            is ClaimStatus.ACQUIRED
        assert ledger.mark_hop("k", "task:1", 60) is True
        assert ledger.mark_hop("k", "task:1", 60) is False
    finally:
        ledger.drop_table()  # type: ignore[attr-defined]
        ledger.close()
        engine.dispose()


@pytest.mark.parametrize("dialect,url", DIALECTS)
def test_a_ledger_without_step_2_still_claims_and_keeps_no_marks_until_applied(
    dialect: str, url: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A hand-managed schema from before mark_hop: claims work, marks are off (None), with a warning."""
    url = url or f"sqlite:///{tmp_path / 'm.sqlite3'}"
    table = _table_name(tmp_path)
    engine = _apply(url, dialect, table, (1, 5))
    ledger = SQLLedger(url, table=table, create_table=False)
    try:
        with caplog.at_level(logging.WARNING, logger="idemmail_celery"):
            assert ledger.mark_hop("k", "task:1", 60) is None
        assert ledger.hop_marked("k", "task:1") is None
        assert migration_file(dialect, 2) in caplog.text
        assert ledger.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f")).status \
            is ClaimStatus.ACQUIRED
        ledger.close()
        engine.dispose()
        engine = _apply(url, dialect, table, range(2, 3))  # the operator applies 002
        upgraded = SQLLedger(url, table=table, create_table=False)
        assert upgraded.mark_hop("k", "task:1", 60) is True
        assert upgraded.mark_hop("k", "task:1", 60) is False
        assert upgraded.hop_marked("k", "task:1") is True
        upgraded.close()
    finally:
        ledger.drop_table()
        ledger.close()
        engine.dispose()


@pytest.mark.parametrize("dialect,url", DIALECTS)
def test_an_auto_created_ledger_from_before_gains_its_marks_table(dialect: str, url: str | None,
                                                                  tmp_path: Path) -> None:
    """A deployment whose ledger table the library created before mark_hop existed: the next start adds it."""
    url = url or f"sqlite:///{tmp_path / 'm.sqlite3'}"
    table = _table_name(tmp_path)
    engine = _apply(url, dialect, table, range(1, 2))
    ledger = SQLLedger(url, table=table)
    try:
        assert ledger.mark_hop("k", "task:1", 60) is True
        assert sa.inspect(engine).has_table(f"{table}_hops")
    finally:
        ledger.drop_table()
        ledger.close()
        engine.dispose()


def _indexes(engine: sa.Engine, table: str) -> set[str]:
    return {str(ix["name"]) for ix in sa.inspect(engine).get_indexes(table)}


@pytest.mark.parametrize("dialect,url", DIALECTS)
def test_a_ledger_from_before_the_listing_index_gains_it_or_says_to_apply_step_4(
    dialect: str, url: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Steps 1-3 and 5 only: a hand-managed schema lists (slowly) with a warning naming migration 004; an auto-created
    one gains the index at the next start; the review queue reads the same records either way."""
    url = url or f"sqlite:///{tmp_path / 'm.sqlite3'}"
    table = _table_name(tmp_path)
    engine = _apply(url, dialect, table, (1, 2, 3, 5))
    by_hand = SQLLedger(url, table=table, create_table=False)
    auto = SQLLedger(url, table=table)
    try:
        c = by_hand.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f"))
        by_hand.park("k", c.token, {"reason": "lease_expired"})
        with caplog.at_level(logging.WARNING, logger="idemmail_celery"):
            assert [r.key for r in by_hand.list_records(RecordQuery(state=State.REVIEW)).records] == ["k"]
        assert migration_file(dialect, 4) in caplog.text
        assert f"ix_{table}_listing" not in _indexes(engine, table)
        assert [r.key for r in auto.list_records(RecordQuery(state=State.REVIEW)).records] == ["k"]
        assert f"ix_{table}_listing" in _indexes(engine, table)
    finally:
        auto.drop_table()
        auto.close()
        by_hand.close()
        engine.dispose()


def _columns(engine: sa.Engine, table: str) -> set[str]:
    return {str(c["name"]) for c in sa.inspect(engine).get_columns(table)}


@pytest.mark.parametrize("dialect,url", DIALECTS)
def test_a_ledger_from_before_step_5_gains_its_record_fields_or_is_refused_naming_the_migration(
    dialect: str, url: str | None, tmp_path: Path,
) -> None:
    """Steps 1-4 only (no ``mark`` and ``resolution`` columns): a hand-managed schema is refused at first use with
    the migration to apply, nothing written; an auto-created one gains both columns at the next start, and a
    write-ahead mark and a resolution are then read back from them."""
    url = url or f"sqlite:///{tmp_path / 'm.sqlite3'}"
    table = _table_name(tmp_path)
    engine = _apply(url, dialect, table, range(1, 5))
    by_hand = SQLLedger(url, table=table, create_table=False)
    auto = SQLLedger(url, table=table)
    try:
        with pytest.raises((ConfigurationError, LedgerUnavailableError), match=migration_file(dialect, 5)):
            by_hand.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f"))
        assert {"mark", "resolution"} & _columns(engine, table) == set()
        c = auto.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f"))
        assert {"mark", "resolution"} <= _columns(engine, table)
        assert auto.write_ahead("k", c.token, 30, "message", owner=c.record.owner)
        record = auto.get("k")
        assert record is not None and record.mark is not None and record.error is None
        assert (record.mark.stage, record.mark.token, record.mark.owner) == ("message", c.token, c.record.owner)
        auto.park("k", c.token, {"reason": "lease_expired"})
        resolved = auto.resolve("k", State.FAILED, note="not sent", actor="ops")
        again = auto.get("k")
        assert again is not None and again.mark is None and again.error == {"reason": "lease_expired"}
        assert again.resolution == resolved.resolution and (again.resolution or {})["by"] == "ops"
    finally:
        auto.drop_table()
        auto.close()
        by_hand.close()
        engine.dispose()


# -- the same steps through Alembic (idemmail_celery.ledger.sql.migrate) --

REVISIONS_DIR = Path(__file__).resolve().parents[1] / "idemmail_celery" / "ledger" / "sql" / "revisions" / "versions"


def test_every_step_is_one_alembic_revision_in_order() -> None:
    shipped = sorted(p.name for p in REVISIONS_DIR.glob("*.py"))
    assert shipped == [f"{n:04d}_step_{n}.py" for n in STEPS]
    for n in STEPS:
        text = (REVISIONS_DIR / f"{n:04d}_step_{n}.py").read_text()
        down = f'"{n - 1:04d}"' if n > 1 else "None"
        assert f'= "{n:04d}", {down}, None, None' in text and f"upgrade, downgrade = step({n})" in text
    assert f"{len(MIGRATIONS):04d}" == migrate.HEAD


def _engine(dialect: str, url: str | None, tmp_path: Path) -> sa.Engine:
    engine = sa.create_engine(url or f"sqlite:///{tmp_path / 'a.sqlite3'}")
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        service_missing(dialect, exc)
    return engine


@pytest.mark.parametrize("dialect,url", DIALECTS)
def test_alembic_upgrades_and_downgrades_every_step_keeping_the_records(
    dialect: str, url: str | None, tmp_path: Path,
) -> None:
    """From nothing to the newest revision, then each step down and up again: after each, the schema shows exactly
    the steps the revision names, and a record claimed at the top is still read at every step from 1 up (its
    ``mark``/``resolution`` columns come back empty after step 5 went and came back)."""
    engine = _engine(dialect, url, tmp_path)
    table = _table_name(tmp_path)
    try:
        assert migrate.current(engine, table=table) is None
        assert migrate.upgrade(engine, table=table) == migrate.HEAD
        ledger = SQLLedger(engine.url.render_as_string(hide_password=False), table=table, create_table=False)
        c = ledger.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f", writes_ahead=True))
        assert ledger.write_ahead("k", c.token, 30, "message", owner=c.record.owner)
        marked = ledger.get("k")
        assert marked is not None and marked.mark is not None and marked.writes_ahead
        ledger.close()
        for step in reversed(STEPS):
            target = migrate.revision_of(step - 1) if step > 1 else "base"
            assert migrate.downgrade(engine, target, table=table) == target
            with engine.connect() as conn:
                assert migrate.applied_steps(conn, table) == step - 1
            if step > 1:
                with engine.connect() as conn:
                    assert conn.execute(sa.text(f"SELECT token FROM {table} WHERE intent_key = 'k'")).scalar() == 1
            assert migrate.upgrade(engine, table=table) == migrate.HEAD
            with engine.connect() as conn:
                assert migrate.applied_steps(conn, table) == len(MIGRATIONS)
            if step == 1:
                break  # base dropped the table and the record with it
            again = SQLLedger(engine.url.render_as_string(hide_password=False), table=table, create_table=False)
            record = again.get("k")
            assert record is not None and record.state is State.CLAIMED
            assert record.mark is None and not record.writes_ahead  # step 5 went first: its columns came back empty
            again.close()
    finally:
        migrate.downgrade(engine, "base", table=table)
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {migrate.version_table(table)}"))
        engine.dispose()


@pytest.mark.parametrize("dialect,url", DIALECTS)
def test_alembic_adopts_a_ledger_made_without_it(dialect: str, url: str | None, tmp_path: Path) -> None:
    """A ledger its first worker created (every step) is recorded at the newest revision and left as it is; one made
    from the SQL files of steps 1-3 is recorded at 0003 and brought up by steps 4 and 5, its records kept."""
    engine = _engine(dialect, url, tmp_path)
    auto_table, by_hand = _table_name(tmp_path), _table_name(tmp_path) + "_h"
    auto = SQLLedger(engine.url.render_as_string(hide_password=False), table=auto_table)
    try:
        auto.claim(ClaimRequest(key="a", task_name="t", payload="{}", fingerprint="f"))
        assert migrate.current(engine, table=auto_table) is None
        assert migrate.upgrade(engine, table=auto_table) == migrate.HEAD
        assert migrate.current(engine, table=auto_table) == migrate.HEAD
        assert auto.get("a") is not None
        _apply(engine.url.render_as_string(hide_password=False), dialect, by_hand, range(1, 4)).dispose()
        with engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {by_hand} (intent_key, task_name, state, token, owner, attempts, "
                                 "reclaims, fingerprint, created_at, updated_at) VALUES ('b', 't', 'review', 3, "
                                 "'o', 1, 0, 'f', 1.0, 2.0)"))
        assert migrate.upgrade(engine, table=by_hand) == migrate.HEAD
        with engine.connect() as conn:
            assert migrate.applied_steps(conn, by_hand) == len(MIGRATIONS)
        hand = SQLLedger(engine.url.render_as_string(hide_password=False), table=by_hand, create_table=False)
        record = hand.get("b")
        assert record is not None and (record.state, record.token, record.writes_ahead) == (State.REVIEW, 3, False)
        hand.close()
    finally:
        auto.close()
        for table in (auto_table, by_hand):
            migrate.downgrade(engine, "base", table=table)
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {migrate.version_table(table)}"))
        engine.dispose()
