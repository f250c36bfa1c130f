"""Alembic's environment for the ledger's revisions: run on the connection :mod:`..migrate` hands over, with the
ledger's table name and a version table of its own. Not for ``alembic`` run from a shell: use
:mod:`idemmail_celery.ledger.sql.migrate` or ``celery -A proj idemmail ledger migrate``."""

from __future__ import annotations

from alembic import context

from idemmail_celery.ledger.sql.migrate import version_table

config = context.config
connection = config.attributes["connection"]
context.configure(connection=connection, version_table=version_table(config.attributes["idemmail_table"]),
                  transactional_ddl=connection.dialect.name != "mysql")
with context.begin_transaction():
    context.run_migrations()
