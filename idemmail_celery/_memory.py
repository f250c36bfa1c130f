"""What a worker keeps of a message once it is done with it (issue 35; see docs/deployment.md, pools).

:func:`fix_mmap_threshold` stops glibc from keeping freed large blocks in its heap; :func:`drop_payload_copies`
and :func:`drop_body` let kombu's virtual transports go of a settled message (called by ``_request.py``); the
httpx cycle is broken by :func:`idemmail_celery.providers._http.unbound`.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any

#: glibc's own default threshold (128 KiB), above which an allocation is a mapping of its own, unmapped when freed.
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_mmap_threshold() -> bool:
    """Keep glibc's mmap threshold at its default in this process and the pool children it forks afterwards
    (glibc raises it after each large free, and a heap gives memory back only from its top). False where the C
    library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def drop_payload_copies(message: Any) -> None:
    """Let a delivered kombu message go of its raw payload (``_raw``) and its decoded-body cache: the request
    holds the arguments itself. The body stays until the message is settled (a transport restores from it)."""
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
