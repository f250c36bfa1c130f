"""The write-ahead point: where a side effect without a key stops being "surely not done" (docs/guarantee.md).

A keyless provider calls :func:`about_to_send` right before the first byte that could make the message exist
(SMTP: after ``DATA`` is accepted; HTTP: before the request); the handler's hook (:func:`writing_ahead`)
records it (:meth:`Ledger.write_ahead`) or raises, so nothing is sent without the mark. The hook lives in a
context variable: each thread and greenlet sees only the send it runs.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

__all__ = ["about_to_send", "writing_ahead"]

_hook: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("idemmail_ahead", default=None)


def about_to_send(stage: str) -> None:
    """Say that the side effect may happen from here on (``stage`` names the step, e.g. ``"message"``): once
    per send, right before the point of no return; a no-op outside a send the library runs. Raises
    :class:`~idemmail_celery.errors.TransientSendError` when the mark could not be recorded: send nothing."""
    hook = _hook.get()
    if hook is not None:
        hook(stage)


class writing_ahead:  # lower case: used as a function (``with writing_ahead(hook):``)
    """Run the enclosed send with ``hook`` answering :func:`about_to_send` (None: nothing answers); a class,
    not ``contextlib.contextmanager``, at a third of the cost on every send."""

    __slots__ = ("_hook", "_token")

    def __init__(self, hook: Callable[[str], None] | None) -> None:
        self._hook = hook

    def __enter__(self) -> None:
        self._token = _hook.set(self._hook)

    def __exit__(self, *exc: object) -> None:
        _hook.reset(self._token)
