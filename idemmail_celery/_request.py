"""The worker's request for idempotent tasks: a message that may not run is refused before the pool.

Celery builds one :class:`celery.worker.request.Request` per message in the worker's main process
(``Task.Request`` names the class) and decodes the body there; ``execute_using_pool`` then hands
the job to the pool. A prefork pool pickles it first, in the main process, before any task code
runs: arguments nested some hundreds of levels deep (about 1 KB of JSON) overflow the pickler's
stack there, and Celery takes that for an unrecoverable error and stops the worker, leaving the
message for the next one. :class:`CheckedRequest` looks at the decoded arguments before that
(:func:`~idemmail_celery.keys.arguments_problem`: the depth ``delay()`` accepts and the task's own
:meth:`~idemmail_celery.IdempotentTask.max_argument_size`) and ends a message that fails as
``FAILURE`` with :class:`~idemmail_celery.errors.PermanentSendError` (reason ``invalid_arguments``):
acknowledged, nothing claimed in the ledger, nothing run. The same on every pool.

The size bound is the task's setting, and applies where a call is accepted: at ``delay()`` for what the
library seals, here for everything else. A message over it whose seal is valid (queued before a deploy
lowered the bound, or a retry, a reschedule, a sweep's republish of such a call) passes, so that no
accepted intent, nor the verdict its chain carries, is lost; the depth bound holds for every message.

The check hooks :meth:`CheckedRequest.revoked`: every ``execute_using_pool`` asks it first (the one
Celery generates per task for its strategy too), and a request it answers True for never reaches
the pool; the worker releases the pool slot it held (``TaskRevokedError``, as for a revoked task).

The request also lets its message go of the copies it holds (:mod:`idemmail_celery._memory`): the raw
payload and kombu's decoding as soon as the request is made, the body once the acknowledgement (or
rejection) has been carried out, which a worker with an event loop does a moment after asking for it.
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
        """True for a revoked or expired task (Celery's answer), and for one refused here (see the module doc)."""
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
        """Was this message accepted already, under the size bound in force then? True for a valid seal: the
        library made it, at ``delay()`` (which checked the bound), for a retry, a reschedule, an outbox row or a
        sweep's republish. A bound lowered since must not drop such an intent, nor the verdict its chain carries.
        Only this worker's secrets vouch: no seal, a forged one, or one under a secret it lacks is checked."""
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
    """``settle`` (the consumer's ack or reject callback), then :func:`~idemmail_celery._memory.drop_body` once the
    message is settled: at once, or when the event loop (kombu's hub) has run the callback it was scheduled as."""

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
    """What an idempotent task keeps on Celery's request while one delivery runs, declared in one place
    (Celery's ``Context`` takes any attribute; the library sets only ``request.idemmail``, this value)."""

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
    if isinstance(state, RequestState) or not create:
        return state if isinstance(state, RequestState) else None
    state = RequestState()
    request.idemmail = state
    return state
