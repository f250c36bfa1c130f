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

The check hooks :meth:`CheckedRequest.revoked`: every ``execute_using_pool`` asks it first (the one
Celery generates per task for its strategy too), and a request it answers True for never reaches
the pool; the worker releases the pool slot it held (``TaskRevokedError``, as for a revoked task).
"""

from __future__ import annotations

import logging

from celery.utils.saferepr import saferepr
from celery.worker.request import Request
from celery.worker.state import task_ready

from .errors import PermanentSendError
from .handler import Outcome
from .keys import MAX_NESTING, arguments_problem

log = logging.getLogger("idemmail_celery")

_BRACKETS = {bytes: (b"[", b"{"), bytearray: (b"[", b"{"), str: ("[", "{")}


class CheckedRequest(Request):  # type: ignore[misc]
    """A request whose arguments are checked in the main process before the pool gets them."""

    _idemmail_refused: bool | None = None  # None until checked

    def revoked(self) -> bool:
        """True for a revoked or expired task (Celery's answer), and for one refused here (see the module doc)."""
        if self._idemmail_refused is None:
            problem = self._problem()
            self._idemmail_refused = problem is not None
            if problem is not None:
                self._refuse(problem)
        return bool(self._idemmail_refused) or bool(super().revoked())

    def _problem(self) -> str | None:
        limit = getattr(self.task, "max_argument_size", lambda: None)()
        body = self.body
        brackets = _BRACKETS.get(type(body)) if self.content_type == "application/json" else None
        if brackets is not None:
            # The arguments' JSON bounds both answers: no deeper than its brackets, no larger than its length.
            shallow = body.count(brackets[0]) + body.count(brackets[1]) <= MAX_NESTING
            if shallow and (limit is None or len(body) <= limit):
                return None
        return arguments_problem(self.args, self.kwargs, limit)

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
        finally:
            self.send_event("task-failed", exception=saferepr(exc), traceback="")
            task_ready(self)
            self.acknowledge()

