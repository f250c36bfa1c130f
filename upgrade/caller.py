"""The release's caller for ``make upgrade-check``: run by the release's Python, with the release's source on the path,
it enqueues intents with the release's own code (``send_email.delay`` of its ``upgrade.workerapp``, on the broker and
ledger the check names in the environment, as :mod:`upgrade.workerapp` reads them).

Reads a JSON list of ``{"kwargs": {...}, "copies": n}`` on stdin; publishes each call ``copies`` times; prints one
JSON object: the version that published (``idemmail_celery.__version__``), where it was imported from, and the
intent key of each call, in order (the key the release puts in its messages).

    .upgrade/0.1.0/venv/bin/python upgrade/caller.py < calls.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a file, its own folder comes first on the path: dropped, so that every import is the release's.
sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != HERE]

SEND_EMAIL = "idemmail_celery.send_email"


def main() -> int:
    import idemmail_celery
    from upgrade.workerapp import app

    calls = json.load(sys.stdin)
    task = app.tasks[SEND_EMAIL]
    keys = []
    for call in calls:
        kwargs = call["kwargs"]
        for _ in range(int(call.get("copies", 1))):
            task.delay(**kwargs)
        keys.append(task.intent_key(**kwargs))
    print(json.dumps({"version": idemmail_celery.__version__, "module": idemmail_celery.__file__, "keys": keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
