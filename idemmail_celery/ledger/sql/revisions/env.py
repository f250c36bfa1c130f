"""Alembic's environment for the ledger's revisions, on the connection :mod:`..migrate` hands over (not for a
shell's ``alembic``)."""

from __future__ import annotations

from alembic import context

from idemmail_celery.ledger.sql.migrate import version_table

config = context.config
connection = config.attributes["connection"]
context.configure(connection=connection, version_table=version_table(config.attributes["idemmail_table"]),
                  transactional_ddl=connection.dialect.name != "mysql")
with context.begin_transaction():
    context.run_migrations()
