"""Step 3: the key-secret roster table (<table>_roster) (``ledger/migrations/003_*.sql`` as plain SQL)."""

from idemmail_celery.ledger.sql.migrate import step

revision, down_revision, branch_labels, depends_on = "0003", "0002", None, None
upgrade, downgrade = step(3)
