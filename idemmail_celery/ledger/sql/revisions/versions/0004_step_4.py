"""Step 4: the review queue's listing index (``ledger/migrations/004_*.sql`` as plain SQL)."""

from idemmail_celery.ledger.sql.migrate import step

revision, down_revision, branch_labels, depends_on = "0004", "0003", None, None
upgrade, downgrade = step(4)
