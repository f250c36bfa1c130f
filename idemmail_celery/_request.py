"""The worker's request for idempotent tasks: a message that may not run is refused before the pool.

:class:`CheckedRequest` checks the arguments' depth (deep nesting would overflow a prefork pool's pickler) and the
task's ``max_argument_size`` first, ending such a message ``FAILURE`` with ``PermanentSendError``
(``invalid_arguments``), nothing claimed (docs/security.md); it also drops its message's copies early (``_memory``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.utils.saferepr import saferepr
from celery.worker.request import Request
from celery.worker.state import task_ready
from vine import Thenable

from ._memory import drop_body, drop_payload_copies
from .encoding import MAX_NESTING, arguments_problem
from .errors import PermanentSendError
from .handler import Outcome
from .keys import Payload, Seal

log = logging.getLogger("idemmail_celery")


class CheckedRequest(Request):  # type: ignore[misc]
    """A request whose arguments are checked in the main process before the pool gets them."""

    _idemmail_refused: bool | None = None  # None until checked
    _on_ack: Callable[..., Any]  # Celery's: the consumer's callbacks that settle the message
    _on_reject: Callable[..., Any]

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        drop_payload_copies(message)
        self._on_ack = _then_drop_body(self._on_ack, message)
        self._on_reject = _then_drop_body(self._on_reject, message)

    def revoked(self) -> bool:
        """True for a revoked or expired task, and for one refused here (every ``execute_using_pool`` asks first)."""
        if self._idemmail_refused is None:
            try:
                problem = self._problem()
            except Exception:  # a defect here must not stop the worker: the run's own checks still come
                log.exception("idemmail: task %s[%s] could not be checked before the pool", self.name, self.id)
                problem = None
            self._idemmail_refused = problem is not None
            if problem is not None:
                self._refuse(problem)
        return bool(self._idemmail_refused) or bool(super().revoked())

    def _problem(self) -> str | None:
        try:
            limit = self.task.max_argument_size()
        except Exception:  # settings that do not parse: the run says so (setup_error) and waits; depth still counts
            limit = None
        body = self.body
        opened: int | None = None
        if self.content_type == "application/json":
            if isinstance(body, str):
                opened = body.count("[") + body.count("{")
            elif isinstance(body, (bytes, bytearray)):
                opened = body.count(b"[") + body.count(b"{")
        # The arguments' JSON bounds both answers: no deeper than its brackets, no larger than its length.
        if opened is not None and opened <= MAX_NESTING and (limit is None or len(body) <= limit):
            return None
        problem = arguments_problem(self.args, self.kwargs, limit)
        if problem is None or limit is None or arguments_problem(self.args, self.kwargs) is not None:
            return problem  # none, or nested too deep: that bound is no setting, and delay() never accepts it
        return None if self._accepted() else problem

    def _accepted(self) -> bool:
        """Was this message accepted already, under the size bound in force then (a valid seal)?"""
        payload = Payload(list(self.args or ()), dict(self.kwargs or {}))
        return self.task.seal_checker.check_seal(self._request_dict, payload) is Seal.VALID

    def _refuse(self, problem: str) -> None:
        """End the message as the worker ends any invalid call: FAILURE stored, ``task-failed`` sent, acknowledged."""
        task = self.task
        exc = PermanentSendError(problem, reason="invalid_arguments")
        log.warning("idemmail: task %s[%s] refused before the pool: %s", self.name, self.id, problem)
        task.request_stack.push(self._context)  # what reports read as the task's request
        try:
            report = getattr(task, "report", None)
            if report is not None:
                report(Outcome.FAILED, "", reason="invalid_arguments", recorded="false")
        finally:
            task.request_stack.pop()
        try:
            task.backend.mark_as_failure(self.id, exc, request=self._context, store_result=self.store_errors)
            self.send_event("task-failed", exception=saferepr(exc), traceback="")
        except Exception:  # the message is refused all the same: it can never run
            log.exception("idemmail: the refusal of task %s[%s] could not be stored or told", self.name, self.id)
        task_ready(self)
        self.acknowledge()


def _then_drop_body(settle: Callable[..., Any], message: Any) -> Callable[..., Any]:
    """``settle`` (the consumer's ack or reject), then :func:`~idemmail_celery._memory.drop_body` once it is done."""

    def settle_then_drop(*args: Any) -> Any:
        scheduled = settle(*args)
        if isinstance(scheduled, Thenable):
            scheduled.then(lambda *_: drop_body(message))
        else:
            drop_body(message)
        return scheduled

    return settle_then_drop


@dataclass
class RequestState:
    """What an idempotent task keeps on Celery's request (as ``request.idemmail``) while one delivery runs."""

    #: The headers this delivery may act on (all under a valid seal, else none the seal vouches for).
    trusted: dict[str, Any] | None = None
    #: A delivery after a retry or a reschedule: its success clears the retry's exception in Flower.
    rescheduled: bool = False
    #: The key headers (unsealed) of the key this delivery claims: whatever it publishes next carries them.
    key_headers: dict[str, Any] | None = None
    #: The claim owner this delivery claims under.
    owner: str | None = None
    #: ``send_email``: the message built for this delivery (built once, reused by every attempt of it).
    message: Any = None


def state_of(request: Any, *, create: bool = True) -> RequestState | None:
    """The :class:`RequestState` of ``request`` (made on first use unless ``create`` is False)."""
    state = getattr(request, "idemmail", None)
    if create and not isinstance(state, RequestState):
        state = request.idemmail = RequestState()
    return state if isinstance(state, RequestState) else None
