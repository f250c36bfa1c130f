"""The tasks a Django project gets: imported when Django starts (and by ``app.autodiscover_tasks()``).

``send_email`` and ``send_campaign`` are Celery shared tasks: importing them here registers them on
every app, so ``from idemmail_celery import send_email`` in a view and
``app.tasks["idemmail_celery.send_email"]`` both find them. The outbox relay is a shared task too:
schedule ``idemmail_celery.outbox_relay`` on beat; it drains ``idemmail_outbox_url``, else the
database Django writes the outbox model to.
"""

from __future__ import annotations

from celery import Task, shared_task
from django.db import router

from ...bulk import send_campaign
from ...config import Settings
from ...mail import send_email
from ...outbox import RELAY_TASK, run_relay
from .conf import sqlalchemy_url
from .models import OutboxRow

__all__ = ["outbox_relay", "send_campaign", "send_email"]


def outbox_url(conf: object) -> str:
    """``idemmail_outbox_url``, else the SQLAlchemy URL of the database Django writes outbox rows to."""
    return Settings.resolve(conf).outbox_url or sqlalchemy_url(router.db_for_write(OutboxRow))


@shared_task(name=RELAY_TASK, bind=True, ignore_result=True)
def outbox_relay(self: Task) -> int:
    """Publish committed outbox rows to the broker; returns how many (:func:`idemmail_celery.outbox.drain`)."""
    return run_relay(self.app, outbox_url(self.app.conf))
