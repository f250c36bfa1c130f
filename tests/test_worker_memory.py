"""A worker process gives a large message's memory back to the system when it is done (issue 35).

glibc raises its mmap threshold (up to 32 MiB) each time a block above it is freed, so after one
large message the next ones are allocated inside the heap and stay resident: pool children kept
400-750 MiB. Workers fix the threshold at start (``worker_init``). Measured in a fresh interpreter
(``/proc/self/status``), where nothing else has touched the allocator.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")

PROBE = """
import sys
from celery import Celery
from celery.signals import worker_init
import idemmail_celery  # connects its worker_init receivers

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

if sys.argv[1] == "worker":
    worker_init.send(sender=None)  # what `celery worker` sends in its main process, before the pool forks
block = b"x" * (20 * 1024 * 1024)  # the first large block: above the threshold, a mapping of its own
del block
before = rss()
for _ in range(5):  # the next large messages' buffers
    held = [b"x" * (12 * 1024 * 1024) for _ in range(2)]
    del held
print(rss() - before)
"""


def kept_after_large_blocks(role: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, role], capture_output=True, text=True, timeout=60, check=True)
    return int(out.stdout.strip())


def test_a_worker_process_keeps_no_memory_of_large_messages() -> None:
    mib = 1024 * 1024
    assert kept_after_large_blocks("caller") > 10 * mib  # glibc's own behaviour: what the fix is for
    assert kept_after_large_blocks("worker") < 2 * mib
