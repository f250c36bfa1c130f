"""The outbox relay's throughput: rows a relay publishes per second, PostgreSQL to a Redis broker.

Alone: ``python -m bench.outbox_relay [--rows 1000] [--batch 100] [--db postgresql://...]``. Writes
``--rows`` ``send_email`` rows into a table of its own (each in the caller's transaction, as
``enqueue_email`` does), connects the broker and the pool with one row, then times ``drain`` over
the rest, and prints rows/s beside a bare ``apply_async`` loop measured at the same moment on the
same broker (the ratio is what to compare between machines). Correctness (every row published once,
in batches) is tests/test_outbox.py's business; this only measures.
"""

from __future__ import annotations

import argparse
import os
import secrets
import time

import redis
import sqlalchemy as sa
from celery import Celery

from idemmail_celery import send_email
from idemmail_celery.outbox import create_outbox_table, drain, enqueue_email, relay

EMAIL = {"to": "ann@example.com", "subject": "Your receipt", "html": "<p>Thanks</p>", "template": "receipt"}


def measure(rows: int, batch: int, db_url: str, broker_url: str) -> dict[str, float]:
    """Rows/s of the relay and messages/s of a bare ``apply_async`` loop, each over ``rows``."""
    app = Celery(f"bench-{secrets.token_hex(4)}", broker=broker_url, set_as_current=False)
    queue = f"bench-outbox-{secrets.token_hex(4)}"
    app.conf.update(task_default_queue=queue, task_serializer="json", accept_content=["json"],
                    idemmail_ledger_url=broker_url, idemmail_key_secret="bench-secret",
                    idemmail_provider_url="console://", idemmail_default_from="Shop <shop@example.com>",
                    broker_connection_retry_on_startup=True)
    engine = sa.create_engine(db_url)
    table = create_outbox_table(engine, f"bench_outbox_{secrets.token_hex(4)}")
    r = redis.Redis.from_url(broker_url)
    try:
        with engine.begin() as conn:
            for n in range(rows):
                enqueue_email(conn, app=app, table=table, **{**EMAIL, "event_id": f"order-{n}"})
        relay(engine, app, table=table, batch_size=1)  # the broker and the pool connected outside the timing
        started = time.perf_counter()
        published = drain(engine, app, table=table, batch_size=batch, max_seconds=600)
        relay_rate = published / (time.perf_counter() - started)
        task = app.tasks[send_email.name]
        started = time.perf_counter()
        for n in range(rows):
            task.apply_async(kwargs={**EMAIL, "event_id": f"bare-{n}"}, queue=queue)
        bare_rate = rows / (time.perf_counter() - started)
        return {"rows": published + 1, "relay_rows_per_s": relay_rate, "apply_async_per_s": bare_rate}
    finally:
        r.delete(queue)
        table.drop(engine)
        engine.dispose()
        app.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--db", default=os.environ.get("IDEMMAIL_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    p.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    args = p.parse_args()
    m = measure(args.rows, args.batch, args.db, args.broker)
    print(f"relay: {m['rows']:.0f} rows, PostgreSQL -> Redis, batches of {args.batch}: "
          f"{m['relay_rows_per_s']:.0f} rows/s; bare apply_async: {m['apply_async_per_s']:.0f} messages/s; "
          f"ratio {m['relay_rows_per_s'] / m['apply_async_per_s']:.2f}")


if __name__ == "__main__":
    main()
