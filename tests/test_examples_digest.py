"""The digest example runs, against real services, and reports success.

examples/digest_beat.py on Redis (broker and ledger) and on its defaults. The outbox in a
web request is examples/flask_shop.py (tests/integration/test_examples_web.py), and in a
Django project examples/django_shop (tests/integration/test_django.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from .conftest import REDIS_URL, unique

pytestmark = pytest.mark.worker  # runs a script or worker process of its own


ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "RESULT: OK" in out, out
    return out


@pytest.mark.parametrize("services", ["redis", "defaults"])
def test_digest_example_sends_one_digest_per_recipient_per_slot(services: str) -> None:
    # 4 s of beats: two slot boundaries (the example's slots are 2 s), both beats fire each.
    if services == "defaults":
        out = run("digest_beat.py", "--seconds", "4")
    else:
        prefix = unique("ex") + "_"
        out = run("digest_beat.py", "--seconds", "4", "--broker", REDIS_URL, "--ledger", REDIS_URL,
                  "--prefix", prefix)
        r = redis.Redis.from_url(REDIS_URL)
        keys = [*r.scan_iter(f"{prefix}*", count=1000), *r.scan_iter(f"_kombu.binding.{prefix}*", count=1000)]
        if keys:
            r.delete(*keys)
    assert "emails for that slot 3" in out  # the manual re-run sent nothing new
