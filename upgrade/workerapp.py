"""The Celery app ``make upgrade-check`` runs its workers on: the golden fixtures' app (``tests/golden/make.py``: their
key secret, ``send_email``) on the broker, ledger and provider the check names in the environment.

``UPGRADE_BROKER``, ``UPGRADE_LEDGER`` (a URL), ``UPGRADE_NS`` (the ledger's prefix or table), ``UPGRADE_PROVIDER``
(the fake provider's URL), ``UPGRADE_LEASE`` (seconds: short, so that a killed worker's claims are taken over soon).
"""

from __future__ import annotations

import os

from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY
from tests.golden import make

#: A fixture made years ago is still within the retention (a message older than it is parked, not sent).
FOREVER = 100 * 365 * 86400.0

LEDGER = os.environ.get("UPGRADE_LEDGER", "redis://127.0.0.1:6379/0")
NS = os.environ.get("UPGRADE_NS", "upgrade")

app = make.app()
app.conf.update(
    broker_url=os.environ.get("UPGRADE_BROKER", "amqp://guest:guest@127.0.0.1:5672//"),
    idemmail_ledger_url=LEDGER,
    idemmail_ledger_options={"prefix": NS} if LEDGER.startswith("redis") else {"table": NS},
    idemmail_provider_url=os.environ.get("UPGRADE_PROVIDER", "http://127.0.0.1:8025"),
    idemmail_provider_api_key=DEFAULT_API_KEY,
    idemmail_retention_seconds=FOREVER,
    idemmail_lease_seconds=float(os.environ.get("UPGRADE_LEASE", "3")),
    task_default_queue=f"upgrade.{NS}",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
