"""Step 1: the ledger table (``ledger/migrations/001_*.sql`` as plain SQL)."""

from idemmail_celery.ledger.sql.migrate import step

revision, down_revision, branch_labels, depends_on = "0001", None, None, None
upgrade, downgrade = step(1)
