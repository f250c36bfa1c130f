"""A worker process gives a large message's memory back to the system when it is done (issue 35).

Two mechanisms, each in its own test: glibc's allocator hands large blocks back
(:func:`idemmail_celery._memory.fix_mmap_threshold`), and a provider's request with its body is freed
when the send returns, not left to the cyclic garbage collector (``providers._http.unbound``). The
main process letting its messages go is proven on real workers (tests/integration/test_message_memory.py).

The allocator: glibc raises its mmap threshold (up to 32 MiB) each time a block above it is freed, so after one
large message the next ones are allocated inside the heap and stay resident: pool children kept
400-750 MiB. Workers fix the threshold at start (``worker_init``). Measured in a fresh interpreter
(``/proc/self/status``), where nothing else has touched the allocator.
"""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator

import httpx
import pytest

from idemmail_celery.email import Attachment, EmailMessage
from idemmail_celery.providers import from_url
from idemmail_celery.providers.base import Provider
from idemmail_celery.testing.fake_keyless import FakeKeylessProvider
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_a_worker_process_keeps_no_memory_of_large_messages() -> None:
    mib = 1024 * 1024
    assert kept_after_large_blocks("caller") > 10 * mib  # glibc's own behaviour: what the fix is for
    assert kept_after_large_blocks("worker") < 2 * mib


@pytest.fixture(params=["http", "postmark", "sendgrid", "ses"])
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    """Each provider built on httpx, sending to its fake over loopback."""
    if request.param == "http":
        with FakeProvider() as fake:
            p = from_url(fake.url, api_key=DEFAULT_API_KEY)
            yield p
            p.close()
        return
    with FakeKeylessProvider() as keyless:
        creds = keyless.aws_credentials
        key = {"postmark": keyless.postmark_token, "sendgrid": keyless.sendgrid_api_key,
               "ses": f"{creds.access_key_id}:{creds.secret_access_key}"}[request.param]
        url = {"postmark": "postmark://", "sendgrid": "sendgrid://", "ses": "ses://eu-west-1"}[request.param]
        p = from_url(url, api_key=key, base_url=keyless.url)
        yield p
        p.close()


def httpx_objects_left(send: Callable[[], object]) -> list[object]:
    """The httpx requests and responses still in memory after ``send()``, the cyclic collector kept off meanwhile."""
    gc.collect()
    gc.disable()
    try:
        send()
        return [o for o in gc.get_objects() if isinstance(o, (httpx.Request, httpx.Response))]
    finally:
        gc.enable()


def test_a_sent_request_and_its_body_are_freed_when_the_send_returns(provider: Provider) -> None:
    """httpx binds a response's stream to the response: a cycle that held the request and its body (a 10 MiB
    message: 10 MiB) until the collector's oldest generation ran; pool children kept 4 to 7 of them."""
    message = EmailMessage.build(sender="Shop <shop@example.com>", to="ann@example.com", subject="Statement",
                                 text="Attached.", attachments=[Attachment("s.pdf", b"%PDF" * 1024, "application/pdf")])
    assert httpx_objects_left(lambda: provider.send(message, key="k" * 64)) == []
