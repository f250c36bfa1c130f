"""The outbox through Django's connection (docs/django.md, "The outbox in a view"): the row is an ``INSERT`` on
``connections[using]`` in whatever transaction is open there, so it commits or rolls back with your data. The
relay task (``idemmail_celery.outbox_relay``, on beat) publishes committed rows; ``nudge=True`` also asks for a
relay run right after the commit (``transaction.on_commit``), a shortcut lost harmlessly if the process dies first.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Task
from django.db import DEFAULT_DB_ALIAS, connections, transaction

from ...outbox import RELAY_TASK, _email_task, enqueue_sql
from .conf import celery_app

log = logging.getLogger("idemmail_celery")


def enqueue(task: Task, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, *,
            using: str | None = None, nudge: bool = False, idempotency_key: str | None = None,
            idempotency_tenant: str | None = None, **options: Any) -> str:
    """Write ``task.apply_async(args, kwargs, **options)`` into the outbox on Django's connection ``using``;
    returns the intent key. Validated and keyed as :func:`idemmail_celery.outbox.enqueue` (bad input raises
    before any SQL); the same intent enqueued again is not a second row."""
    alias = using or DEFAULT_DB_ALIAS
    connection = connections[alias]
    stmt = enqueue_sql(connection.vendor, task, args, kwargs, idempotency_key=idempotency_key,
                       idempotency_tenant=idempotency_tenant, **options)
    with connection.cursor() as cursor:
        cursor.execute(stmt.sql, stmt.params)
    if nudge:
        app = task.app
        transaction.on_commit(lambda: _nudge(app), using=alias)
    return stmt.key


def enqueue_email(*, using: str | None = None, nudge: bool = False, task: Task | None = None,
                  options: Mapping[str, Any] | None = None, **email: Any) -> str:
    """:func:`enqueue` a ``send_email`` call (``to``, ``subject``, ``html``, ...) of ``task``, else ``send_email``
    on the project's Celery app, with publishing ``options`` (``{"queue": "mail"}``); returns the intent key.
    Invalid mail raises :class:`~idemmail_celery.errors.InvalidEmail` before anything is written."""
    return enqueue(_email_task(celery_app(), task), (), email, using=using, nudge=nudge, **dict(options or {}))


def _nudge(app: Any) -> None:
    try:
        app.send_task(RELAY_TASK, ignore_result=True)
    except Exception as exc:  # the broker is down: beat's next relay run publishes the row anyway
        log.warning("idemmail outbox: could not ask for a relay run after the commit (%s); beat's next run will",
                    type(exc).__name__)
