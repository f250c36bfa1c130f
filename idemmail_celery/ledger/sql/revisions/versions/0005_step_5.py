"""Step 5: the record's mark, resolution and writes_ahead columns (``ledger/migrations/005_*.sql`` as plain SQL)."""

from idemmail_celery.ledger.sql.migrate import step

revision, down_revision, branch_labels, depends_on = "0005", "0004", None, None
upgrade, downgrade = step(5)
