"""``python -m idemmail_celery.testing``: the fake Resend-compatible provider as a server of its own.

A mail catcher for development stacks (``compose.yaml`` runs it); it keeps everything in memory (docs/testing.md).
"""

from __future__ import annotations

import argparse
import signal
import threading

from .fake_provider import DEFAULT_API_KEY, FakeProvider


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m idemmail_celery.testing", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8025, help="TCP port (default 8025; 0 picks a free one)")
    parser.add_argument("--api-key", default=DEFAULT_API_KEY, help=f"bearer token (default {DEFAULT_API_KEY})")
    parser.add_argument("--no-dedupe", action="store_true", help="ignore Idempotency-Key (a provider that does not "
                        "de-duplicate: every accepted request is a delivery)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with FakeProvider(host=args.host, port=args.port, api_key=args.api_key, dedupe=not args.no_dedupe) as fake:
        print(f"fake provider listening on {args.host}:{fake.port}: POST /emails, GET /_fake/deliveries, "
              "GET /_fake/stats", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
