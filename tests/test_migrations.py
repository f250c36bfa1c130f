"""The shipped migration scripts match the table the ledger creates, and apply cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from idemmail_celery.ledger import ClaimRequest, ClaimStatus, from_url
from idemmail_celery.ledger.sql import schema_sql

from .conftest import MARIADB_URL, POSTGRES_URL, service_missing

MIGRATIONS = Path(__file__).resolve().parents[1] / "idemmail_celery" / "ledger" / "migrations"


@pytest.mark.parametrize("dialect", ["postgresql", "mysql", "sqlite"])
def test_shipped_migration_matches_table_definition(dialect: str) -> None:
    assert (MIGRATIONS / f"001_create_ledger.{dialect}.sql").read_text() == schema_sql(dialect)


@pytest.mark.parametrize("dialect,url", [("postgresql", POSTGRES_URL), ("mysql", MARIADB_URL), ("sqlite", None)])
def test_migration_applies_and_ledger_uses_it(dialect: str, url: str | None, tmp_path: Path) -> None:
    url = url or f"sqlite:///{tmp_path / 'm.sqlite3'}"
    table = f"mig_{tmp_path.name[-12:].replace('-', '_')}"
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in schema_sql(dialect, table).split(";"):
                body = "\n".join(ln for ln in statement.splitlines() if not ln.startswith("--")).strip()
                if body:
                    conn.execute(sa.text(body))
    except sa.exc.OperationalError as exc:
        service_missing(dialect, exc)
    ledger = from_url(url, table=table, create_table=False)
    try:
        assert ledger.claim(ClaimRequest(key="k", task_name="t", payload="{}", fingerprint="f")).status \
            is ClaimStatus.ACQUIRED
    finally:
        ledger.drop_table()  # type: ignore[attr-defined]
        ledger.close()
        engine.dispose()
