"""What a worker keeps of a message once it is done with it (issue 35).

A message of about 10 MiB (``send_email``'s largest) passes through a worker as several copies:
the transport's raw payload (Redis: JSON text with the body in base64), the body, its decoding,
the pickled job a prefork child gets, the provider's request. Each is freed as soon as nothing
refers to it, and three things kept them longer:

* glibc's allocator kept freed large blocks inside the heap (:func:`fix_mmap_threshold`);
* kombu's virtual transports (Redis, SQS, ...) keep an acknowledged message in their channel's
  record of delivered messages until the next message arrives, with its raw payload, its body
  and kombu's cache of the decoded body: after the last large messages, the worker's main process
  kept the last few (about 35 MB each) for as long as the queue stayed quiet
  (:func:`drop_payload_copies`, :func:`drop_body`, called by :mod:`idemmail_celery._request`);
* httpx binds a response's stream to the response, a reference cycle through which the response
  holds its request and the request body: freed only by the cyclic garbage collector, whose oldest
  generation runs seldom (pool children kept 4 to 7 such requests, 40 to 70 MiB;
  :func:`idemmail_celery.providers._http.unbound`).
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any

#: glibc's own default threshold (128 KiB), above which an allocation is a mapping of its own, unmapped when freed.
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its default in this process (and the pool children it forks afterwards).

    glibc raises the threshold, up to 32 MiB, each time a block above it is freed: after one large
    message (its body, the decoded arguments, the pickled job, the provider's request: about 10 MiB
    each) the next ones are allocated inside the heap, and a heap gives memory back only from its top.
    Pool children kept hundreds of MiB that way (issue 35). Setting the threshold turns the raising
    off; every block above it goes back to the system when freed. False where the C library is not glibc.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def drop_payload_copies(message: Any) -> None:
    """Let a delivered kombu message go of the copies nothing reads once Celery's request is made of it.

    The raw payload a virtual transport made the message of (``_raw``: Redis copies it into its
    record of unacknowledged messages on delivery, before any consumer sees the message) and
    kombu's cache of the decoded body (the request holds the decoded arguments itself). The body
    stays until the message is acknowledged or rejected: a transport restores an unacknowledged
    message from it. A message of another kind is left as it is.
    """
    if getattr(message, "_raw", None) is not None:
        message._raw = None
    if getattr(message, "_decoded_cache", None) is not None:
        message._decoded_cache = None


def drop_body(message: Any) -> bool:
    """Let an acknowledged or rejected kombu message go of its body (nothing reads it again); False if it is neither."""
    if not getattr(message, "acknowledged", False):
        return False
    drop_payload_copies(message)
    if getattr(message, "body", None) is not None:
        message.body = None
    return True
