"""Step 2: the reschedule marks table (<table>_hops) (``ledger/migrations/002_*.sql`` as plain SQL)."""

from idemmail_celery.ledger.sql.migrate import step

revision, down_revision, branch_labels, depends_on = "0002", "0001", None, None
upgrade, downgrade = step(2)
