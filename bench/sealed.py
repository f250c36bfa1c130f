"""What sealing payloads costs: microseconds per claim + complete, with and without payload keys.

    python -m bench.sealed [--n 2000] [--backends sqlite,redis,postgresql]

Each round claims N new keys and completes them (the hot path of a first send) on a real
store, in one process, with a send_email-sized payload. Reported: the best of five interleaved
rounds per variant, and the codec alone (seal the payload, seal the result), so the store's own
noise can be told from the encryption's cost.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid

from cryptography.fernet import Fernet

from bench.cleanup import delete_matching
from idemmail_celery.ledger import ClaimRequest, Ledger, from_url
from idemmail_celery.ledger.sealed import PayloadCodec, SealedLedger

PAYLOAD = json.dumps({"args": [], "kwargs": {
    "to": "Ann Example <ann@example.com>", "subject": "Your receipt for order 4821",
    "html": "<p>Thanks for your order.</p>" * 20, "event_id": "order_4821", "template": "receipt"}})
RESULT = {"value": {"message_id": "msg-0123456789", "accepted_at": "2026-11-22T03:00:00+00:00"},
          "message_id": "msg-0123456789"}
URLS = {
    "sqlite": None,  # a file in a temporary directory
    "redis": os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379/0"),
    "postgresql": os.environ.get("BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
}


def ledger_for(backend: str, tmp: str, keys: list[str] | None) -> Ledger:
    ns = f"bench_sealed_{uuid.uuid4().hex[:8]}"
    options: dict[str, object] = {"payload_keys": keys} if keys else {}
    if backend == "sqlite":
        return from_url(f"sqlite:///{tmp}/{ns}.sqlite3", **options)
    if backend == "redis":
        return from_url(str(URLS["redis"]), prefix=ns, **options)
    return from_url(str(URLS[backend]), table=ns, **options)


def drop(ledger: Ledger) -> None:
    inner = ledger.inner if isinstance(ledger, SealedLedger) else ledger
    drop_table = getattr(inner, "drop_table", None)
    if drop_table is not None:
        drop_table()
    else:
        delete_matching(inner.client, f"*{inner.prefix}*")  # type: ignore[attr-defined]
    inner.close()


def per_op_us(ledger: Ledger, n: int) -> float:
    """Microseconds per claim + complete over ``n`` new keys."""
    run = uuid.uuid4().hex[:6]
    requests = [ClaimRequest(key=f"{run}-{i}", task_name="bench.send", payload=PAYLOAD, fingerprint="f" * 64)
                for i in range(n)]
    start = time.perf_counter()
    for r in requests:
        claim = ledger.claim(r)
        ledger.complete(r.key, claim.token, RESULT)
    return (time.perf_counter() - start) / n * 1e6


def codec_us(n: int) -> float:
    codec = PayloadCodec([Fernet.generate_key()])
    start = time.perf_counter()
    for _ in range(n):
        codec.seal(PAYLOAD)
        codec.seal_dict(RESULT)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="sqlite,redis,postgresql")
    args = parser.parse_args()
    keys = [Fernet.generate_key().decode(), Fernet.generate_key().decode()]
    print(f"payload {len(PAYLOAD)} bytes; n={args.n} claim+complete per round, best of {args.rounds}")
    print(f"codec alone (seal payload + seal result): {min(codec_us(args.n) for _ in range(args.rounds)):.1f} us")
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            ledgers = {"plain": ledger_for(backend, tmp, None), "sealed": ledger_for(backend, tmp, keys)}
            times: dict[str, list[float]] = {label: [] for label in ledgers}
            try:
                for led in ledgers.values():
                    per_op_us(led, 50)  # connect, create the table, warm the statement cache
                for _ in range(args.rounds):  # interleaved, so a busy moment hits both variants
                    for label, led in ledgers.items():
                        times[label].append(per_op_us(led, args.n))
            finally:
                for led in ledgers.values():
                    drop(led)
            row = {label: min(t) for label, t in times.items()}
            extra = row["sealed"] - row["plain"]
            print(f"{backend:<11} plain {row['plain']:7.1f} us   sealed {row['sealed']:7.1f} us   "
                  f"(+{extra:.1f} us, {extra / row['plain'] * 100:+.0f}%)")


if __name__ == "__main__":
    main()
