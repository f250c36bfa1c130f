"""The Celery app behind ``make demo``: no servers, everything in files under ``.demo/``.

* broker: kombu's ``filesystem://`` transport (one folder is both "in" and "out"), with each
  message written under a temporary name and renamed into place (see ``FilesystemTransport``);
* result backend: Celery's ``file://`` backend;
* ledger: SQLite (``sqlite:///.demo/ledger.sqlite3``);
* provider: the library's own ``send_email`` task, sending over HTTP to a Resend-compatible
  API at ``$IDEMMAIL_DEMO_PROVIDER_URL`` (``examples/demo.py`` starts a
  :class:`~idemmail_celery.testing.fake_provider.FakeProvider` there and sets the variable).

Run a worker by hand with a fake provider already listening::

    IDEMMAIL_DEMO_PROVIDER_URL=http://127.0.0.1:PORT PYTHONPATH=. celery -A examples.demo_app worker -P prefork -c 2
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from time import monotonic
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun, worker_ready
from kombu.transport import filesystem
from kombu.utils.json import dumps

import idemmail_celery.providers.http  # noqa: F401  # loaded before the pool forks, see below
from idemmail_celery.ledger import backend_for
from idemmail_celery.mail import TASK_NAME, register
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / ".demo"
BROKER_DIR = DEMO_DIR / "broker"
PROCESSED_DIR = DEMO_DIR / "broker-processed"
CONTROL_DIR = DEMO_DIR / "broker-control"
RESULTS_DIR = DEMO_DIR / "results"
LEDGER_URL = f"sqlite:///{DEMO_DIR / 'ledger.sqlite3'}"
#: Touched when the worker is ready to consume.
READY_FLAG = DEMO_DIR / "worker.ready"
#: ``BUSY_DIR/<pid>`` exists while pool process ``pid`` runs a task, and holds its intent key (see ``_busy``).
BUSY_DIR = DEMO_DIR / "busy"
#: The environment variable that carries the fake provider's URL to the worker.
PROVIDER_URL_ENV = "IDEMMAIL_DEMO_PROVIDER_URL"
LEASE_SECONDS = 3
#: The worker's HTTP read timeout; the demo's "slow" fault holds a request longer than this.
PROVIDER_TIMEOUT = 1.0
SENDER = "Demo Shop <shop@example.com>"

for folder in (BROKER_DIR, PROCESSED_DIR, CONTROL_DIR, RESULTS_DIR, BUSY_DIR):
    folder.mkdir(parents=True, exist_ok=True)


class _AtomicChannel(filesystem.Channel):  # type: ignore[misc]
    """kombu's filesystem channel, except that a message file appears in the folder complete.

    kombu's own ``_put`` creates ``<time>_<uuid>.<queue>.msg`` and then writes it, so a consumer
    that lists the folder in between reads an empty file, fails to decode it and the worker
    exits (kombu issue #1551 reports that crash); a publisher killed in between (the demo SIGKILLs
    pool processes, which publish their retries) leaves the empty file for good. Here the
    message is written under a name the consumer skips and renamed into place: a rename is atomic.
    """

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = os.path.join(self.data_folder_out, f".{name}.part")  # does not end in .<queue>.msg
        with open(partial, "wb") as f:
            f.write(dumps(payload).encode("utf-8"))
        os.replace(partial, final)


class FilesystemTransport(filesystem.Transport):  # type: ignore[misc]
    """The ``filesystem://`` transport with :class:`_AtomicChannel`."""

    Channel = _AtomicChannel


app = Celery("idemmail_demo", broker="filesystem://", backend=f"file://{RESULTS_DIR}")
app.conf.update(
    broker_transport=f"{__name__}:FilesystemTransport",  # filesystem:// with atomic writes, see above
    broker_transport_options={
        "data_folder_in": str(BROKER_DIR),
        "data_folder_out": str(BROKER_DIR),
        "store_processed": True,  # keep consumed messages under .demo/, not in /tmp
        "processed_folder": str(PROCESSED_DIR),
        "control_folder": str(CONTROL_DIR),
        "polling_interval": 0.02,  # the worker polls the folder (and its free pool slots) this often
    },
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,  # no pidbox: the demo never inspects the worker
    worker_lost_wait=1.0,  # notice a killed pool process after 1 s, not 10 s
    # A faulted send is retried with the same key; give it room for a few faults in a row.
    task_annotations={TASK_NAME: {"max_retries": 8}},
    # the guarantee's settings
    idemmail_ledger_url=LEDGER_URL,
    idemmail_key_secret="demo-secret-do-not-use-in-production",
    idemmail_lease_seconds=LEASE_SECONDS,  # short, so a killed holder's intent is reclaimed in seconds
    idemmail_inflight_backoff=0.3,
    idemmail_inflight_backoff_max=1.0,
    idemmail_retry_backoff=0.5,  # the demo's faults are brief: retry soon (production default: 2 s, doubling)
    idemmail_retry_backoff_max=2.0,
    # the provider: the library's HTTP provider, pointed at the demo's fake
    idemmail_provider_url=os.environ.get(PROVIDER_URL_ENV) or None,
    idemmail_provider_api_key=DEFAULT_API_KEY,
    idemmail_provider_timeout=PROVIDER_TIMEOUT,
    idemmail_default_from=SENDER,
)

#: The library's ``send_email`` task, registered on this app.
send_email = register(app)

# Load the ledger backend now, in the worker's main process, as the HTTP provider above: pool
# children, also those respawned after a kill, start with the code already imported.
backend_for(LEDGER_URL)


@worker_ready.connect
def _announce_ready(**_: Any) -> None:
    READY_FLAG.touch()


# Where a pool process stands, for examples/demo.py, which SIGKILLs pool processes only while they
# run a task. With a broker that has no event loop (filesystem://) the prefork pool shares one job
# pipe between its processes, and an idle process waits for a job holding the pipe's lock: killed
# there, it takes the lock along and the whole pool stops. Inside a task it holds no pool lock, and
# a kill is what the demo means to show: a worker process dying mid-send.
@task_prerun.connect
def _busy(task: Any = None, **_: Any) -> None:
    request = getattr(task, "request", None)
    key = ((getattr(request, "headers", None) or {}).get("idempotency_key")
           or getattr(request, "idempotency_key", None) or "")
    (BUSY_DIR / str(os.getpid())).write_text(str(key))  # the intent this process works on


@task_postrun.connect
def _idle(**_: Any) -> None:
    (BUSY_DIR / str(os.getpid())).unlink(missing_ok=True)
