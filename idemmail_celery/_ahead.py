"""The write-ahead point: where a side effect without a key stops being "surely not done".

A provider that carries no idempotency key (SMTP, the keyless HTTP APIs) calls
:func:`about_to_send` right before the first byte that could make the message exist at the
service: for SMTP, after the server accepted ``DATA`` and before the message itself; for an
HTTP API, before the request. The handler running the send has installed a hook
(:func:`writing_ahead`) that records this in the ledger (:meth:`Ledger.write_ahead`) and
raises when it cannot, so nothing is sent without the mark. A worker killed before the mark
is then known to have sent nothing: its intent is sent by the next claimer instead of being
parked for review, and one killed after it is parked with the stage it had reached.

The hook lives in a context variable: each thread and each greenlet (gevent gives every
greenlet its own context) sees only the send it is running.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

__all__ = ["about_to_send", "writing_ahead"]

_hook: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("idemmail_ahead", default=None)


def about_to_send(stage: str) -> None:
    """Say that the side effect may happen from here on (``stage`` names the step, e.g. ``"message"``).

    Call it once per send, right before the point of no return. Outside a send run by the
    library (a provider used on its own) it does nothing. Raises
    :class:`~idemmail_celery.errors.TransientSendError` when the ledger could not record it,
    or the claim was lost: then the caller must send nothing.
    """
    hook = _hook.get()
    if hook is not None:
        hook(stage)


class writing_ahead:  # lower case: used as a function (``with writing_ahead(hook):``)
    """Run the enclosed send with ``hook`` answering :func:`about_to_send` (None: nothing answers).

    A class rather than a generator-based context manager: it wraps every send, and this costs
    a third of what ``contextlib.contextmanager`` does.
    """

    __slots__ = ("_hook", "_token")

    def __init__(self, hook: Callable[[str], None] | None) -> None:
        self._hook = hook

    def __enter__(self) -> None:
        self._token = _hook.set(self._hook)

    def __exit__(self, *exc: object) -> None:
        _hook.reset(self._token)
