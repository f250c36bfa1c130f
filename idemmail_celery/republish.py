"""Publishing a message of an intent again: one republisher for ``send_email``, every idempotent task and campaigns.

A retry, a reschedule, the next hop of a long wait: the message published again, sealed last (or as it came), with a
countdown below the broker's visibility timeout, ending the delivery with :class:`Rescheduled`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from celery import Task
from celery.exceptions import Retry

from ._common import logsafe, transport_visibility_timeout
from .chain import SECRET_WAIT_ERROR_SECONDS, SECRET_WAIT_HEADER, with_hop
from .diagnostics import say_setup_error_once
from .errors import IdemmailError, TransientSendError
from .keys import Payload
from .steps import Policy

log = logging.getLogger("idemmail_celery")

#: Of the broker's visibility timeout, the most a countdown may take (the rest: margin for a wait in the worker).
VISIBILITY_SHARE = 0.5


class Rescheduled(Retry):  # type: ignore[misc]
    """The :class:`~celery.exceptions.Retry` of a reschedule, shown (in Flower) as its reason alone."""

    def __repr__(self) -> str:
        return repr(self.exc) if self.exc is not None else f"Rescheduled({self.message!r})"


class Republishing(Protocol):
    """What the republisher uses of an :class:`~idemmail_celery.task.IdempotentTask` (this module never imports it)."""

    app: Any
    request: Any
    def signature_from_request(self, request: Any = None, args: Any = None, kwargs: Any = None, queue: Any = None,
                               **extra_options: Any) -> Any: ...
    @property
    def policy(self) -> Policy: ...
    def policy_or_default(self) -> Policy: ...
    def sealed(self, headers: dict[str, Any], payload: Payload) -> dict[str, Any]: ...
    def _received(self, args: Any = None, kwargs: Any = None) -> Payload: ...


class Republisher:
    """Publishes the message a task runs (or, with ``running``, the one a campaign runs) again."""

    def __init__(self, task: Republishing) -> None:
        self.task = task

    def split(self, countdown: float, headers: dict[str, Any], hop: str | None = None) -> float:
        """The countdown to publish with, at most the cap below the visibility timeout (a longer wait travels as
        ``idemmail_not_before``), with the message marked a new hop (or ``hop`` again)."""
        cap = self.countdown_cap()
        waits = cap is not None and countdown > cap
        with_hop(headers, hop or uuid.uuid4().hex, time.time() + countdown if waits else None)
        return cap if waits and cap is not None else countdown

    def countdown_cap(self) -> float | None:
        vt = transport_visibility_timeout(self.task.app)
        return None if vt is None else max(vt * VISIBILITY_SHARE, 0.1)

    def wait_until_due(self, headers: dict[str, Any], due: float | None) -> None:
        """A hop of a long wait that is early: publish the next hop (every copy does) and stop here, nothing claimed."""
        left = None if due is None else due - time.time()
        if left is not None and left > 0.05:
            self.publish_again(left, headers, "waiting", TransientSendError("waiting", reason="waiting"))

    def wait_for_key_secret(self, headers: dict[str, Any], running: Task) -> NoReturn:
        """Requeue the message ``running`` runs exactly as it came, for a worker that has the key secret its seal was
        made under: such a seal can be neither trusted nor dropped (see docs/security.md)."""
        now = time.time()
        try:
            since = min(float(headers.get(SECRET_WAIT_HEADER) or now), now)
        except (TypeError, ValueError):
            since = now
        headers = {**headers, SECRET_WAIT_HEADER: since}  # not sealed: the seal stays as it came
        waited = now - since
        # A short wait is a rolling deploy; a long one a secret removed too early: said at ERROR until put back.
        log.log(logging.ERROR if waited > SECRET_WAIT_ERROR_SECONDS else logging.WARNING,
                "idemmail: task %s[%s] is sealed under a key secret this worker does not have (a newer "
                "idemmail_key_secret, or one removed too early: put it back in the list); it has waited %.0f s "
                "for a worker that has it", logsafe(running.name), logsafe(running.request.id), waited)
        countdown = min(self.task.policy.inflight_backoff_max, self.countdown_cap() or 60.0)
        self.publish_again(countdown, headers, "waiting for the key secret", TransientSendError(
            "sealed under an unknown key secret", reason="unknown_key_secret"), as_received=True, running=running)

    def wait_as_received(self, exc: Exception, running: Task) -> NoReturn:
        """``running`` cannot read its headers here (``exc``): one ERROR with the fix, and it is requeued as it came."""
        say_setup_error_once(exc)
        countdown = min(self.task.policy_or_default().inflight_backoff_max, self.countdown_cap() or 60.0)
        self.publish_again(countdown, dict(running.request.headers or {}), "set-up error", exc, as_received=True,
                            running=running)

    def next_pass(self, running: Task, countdown: float, headers: dict[str, Any], why: str,
                  reason: BaseException | None, seal: Callable[[dict[str, Any]], None]) -> NoReturn:
        """A campaign's next pass: the message ``running`` runs, again, with ``headers`` sealed in place by ``seal``,
        one retry more. ``countdown`` is already below the visibility timeout. Runs in line under ``Task.apply``."""
        self.publish_again(countdown, headers, why, reason, running=running,
                           retries=(running.request.retries or 0) + 1, seal=seal)

    def publish_again(self, countdown: float, headers: dict[str, Any], why: str, reason: BaseException | None, *,
                      as_received: bool = False, running: Task | None = None, retries: int | None = None,
                      hop: str | None = None, published: Callable[[], None] | None = None,
                      seal: Callable[[dict[str, Any]], None] | None = None) -> NoReturn:
        """Requeue this message (or the one ``running`` runs) like ``retry()``, without spending ``max_retries``.

        ``reason``: what monitors show. ``as_received``: the headers go out exactly as they came. ``retries``: the
        count the next delivery sees (default: this one's). ``hop``: the hop it goes out as (default: new);
        ``published``: called once it is out. ``seal``: seals ``headers`` in place for a campaign pass (no hop).
        """
        running = self.task if running is None else running
        request = running.request
        if not as_received:
            try:
                if seal is not None:
                    seal(headers)
                else:
                    countdown = self.split(countdown, headers, hop)
                    self.task.sealed(headers, self.task._received())
            except IdemmailError:
                # This worker cannot seal: the message goes on as it came (ending it would drop an unrecorded intent).
                headers, as_received = dict(request.headers or {}), True
        sig = running.signature_from_request(request, countdown=countdown, headers=headers,
                                             retries=request.retries if retries is None else retries)
        if request.is_eager:  # ``Task.apply`` re-applies a Retry's ``sig`` in line: only a campaign's, whose passes end
            raise Rescheduled(why, exc=reason, when=countdown, sig=sig if seal is not None else None)
        sig.apply_async()
        if published is not None and not as_received:  # sent as it came, it is the same hop again: not out
            published()
        raise Rescheduled(why, exc=reason, when=countdown, sig=sig)
