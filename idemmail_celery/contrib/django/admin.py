"""The ledger's review queue in the Django admin, for every ledger backend (Redis included).

Not a ``ModelAdmin`` over a table: the page lists records through the ledger's own API, as the
operator CLI does (``celery -A proj idemmail ledger list --state review``), and its actions are
the CLI's own moves (:func:`idemmail_celery.cli.decide`, :func:`idemmail_celery.cli.erase`), with
the same rules and refusals: mark sent, release for a resend (the stored first payload is queued
again before the record changes), mark failed, forget (erase the personal data).

* The list filters by state (``review`` first) and shows keys, states, tasks, reasons and times,
  never a payload. A record's page shows its payload only to a user with ``idemmail.view_payload``
  who asks for it.
* Each action needs its own permission: ``idemmail.mark_sent``, ``idemmail.release``,
  ``idemmail.mark_failed``, ``idemmail.forget_payload`` (superusers have all); looking needs
  ``idemmail.view_reviewrecord``.
* Each action, done or refused, is one line on the ``idemmail_celery.audit`` logger (who, what,
  which key, the outcome; the note is kept in the record, not in the log). The record itself keeps
  who, when and why in ``error["resolution"]``, as from the CLI.
* A ``key`` that is not shaped like a ledger key (64 lower-case hex digits) is answered 400 before
  anything else, the permission checks and their audit lines included: no text of a request's
  choosing reaches the log (a user name that is not plain printable text is quoted and escaped).

The ledger is the project's Celery app's (the app ``proj/__init__.py`` imports, see
:func:`.conf.celery_app`), opened as the CLI opens it; releasing publishes to that app's broker.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import logging
import threading
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBadRequest,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.http import urlencode

from ..._common import logsafe
from ...cli import EXIT_CODES, OperatorError, _Ctx, decide, erase
from ...errors import LedgerUnavailableError, PayloadKeyError
from ...keys import Payload, is_derived_key
from ...ledger import Record, State
from ...ledger.sealed import is_sealed
from .conf import celery_app
from .models import ReviewRecord

audit = logging.getLogger("idemmail_celery.audit")

#: Records one page lists (the CLI's ``--limit`` default).
LIMIT = 100

#: action -> (the outcome passed to the CLI's move, the permission it needs, its button)
ACTIONS: dict[str, tuple[str, str, str]] = {
    "sent": ("sent", "idemmail.mark_sent", "Mark sent"),
    "release": ("released", "idemmail.release", "Release for a resend"),
    "failed": ("failed", "idemmail.mark_failed", "Mark failed"),
    "forget": ("forget", "idemmail.forget_payload", "Forget the payload"),
}

_operators: dict[int, _Ctx] = {}
_operators_lock = threading.Lock()


def operator() -> _Ctx:
    """The CLI's context for the project's Celery app: its ledger (opened passive, as the CLI
    opens it), built once per process."""
    app = celery_app()
    with _operators_lock:
        ctx = _operators.get(id(app))
        if ctx is None:
            ctx = _operators[id(app)] = _Ctx(app, None, {})
        return ctx


def _when(ts: float | None) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc) if ts else None


def _row(r: Record) -> dict[str, Any]:
    return {"key": r.key, "state": r.state.value, "task_name": r.task_name, "attempts": r.attempts,
            "reason": (r.error or {}).get("reason") or "", "message_id": (r.result or {}).get("message_id") or "",
            "updated": _when(r.updated_at)}


class ReviewQueueAdmin(admin.ModelAdmin):
    """The review queue: a list, a record's page, and one POST per action."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        return [
            path("", view(self.list_view), name="idemmail_reviewrecord_changelist"),
            path("record/", view(self.record_view), name="idemmail_reviewrecord_record"),
            path("record/<str:action>/", view(self.action_view), name="idemmail_reviewrecord_action"),
        ]

    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {**self.admin_site.each_context(request), "opts": self.opts, "title": title, **extra}

    def _refuse_unless_viewer(self, request: HttpRequest) -> None:
        if not self.has_view_permission(request):
            raise PermissionDenied

    def list_view(self, request: HttpRequest) -> HttpResponse:
        self._refuse_unless_viewer(request)
        chosen = request.GET.get("state", State.REVIEW.value)
        state = None if chosen == "all" else State(chosen) if chosen in {s.value for s in State} else State.REVIEW
        error = None
        try:
            ledger = operator().ledger
            counts = ledger.stats()
            found = list(itertools.islice(ledger.iter_records(state), LIMIT + 1))
        except (LedgerUnavailableError, PayloadKeyError) as exc:
            counts, found, error = {}, [], f"{type(exc).__name__}: {exc}"
        filters = [{"value": "all", "label": "all", "count": sum(counts.values()), "selected": state is None}]
        filters += [{"value": s.value, "label": s.value, "count": counts.get(s.value, 0), "selected": s is state}
                    for s in State]
        return TemplateResponse(request, "idemmail/review_list.html", self._context(
            request, "Ledger records" + (f": {state.value}" if state else ""),
            rows=[_row(r) for r in found[:LIMIT]], more=len(found) > LIMIT, filters=filters, error=error,
            record_url=reverse("admin:idemmail_reviewrecord_record")))

    def record_view(self, request: HttpRequest) -> HttpResponse:
        key = request.GET.get("key", "")
        if not is_derived_key(key):
            return _not_a_key()
        self._refuse_unless_viewer(request)
        show_payload = request.GET.get("payload") == "1" and request.user.has_perm("idemmail.view_payload")
        try:
            record = operator().ledger.get(key)
        except (LedgerUnavailableError, PayloadKeyError) as exc:
            messages.error(request, f"{type(exc).__name__}: {exc}")
            return HttpResponseRedirect(reverse("admin:idemmail_reviewrecord_changelist"))
        if record is None:
            raise Http404("no ledger record for this key")
        payload: str | None = None
        if show_payload and record.payload:
            if is_sealed(record.payload):
                payload = "(sealed with a payload key this process does not hold: IDEMMAIL_PAYLOAD_KEYS)"
            else:
                stored = Payload.from_json(record.payload)
                payload = json.dumps({"args": stored.args, "kwargs": stored.kwargs}, indent=2, default=str)
        fields = record.to_dict()
        for name in ("result", "error"):
            fields[name] = json.dumps(fields[name], indent=2, sort_keys=True, default=str) if fields[name] else ""
        for name in ("created_at", "updated_at", "expires_at", "lease_expires_at"):
            fields[name] = _when(fields[name])
        actions = [{"name": name, "label": label} for name, (_, perm, label) in ACTIONS.items()
                   if request.user.has_perm(perm)]
        return TemplateResponse(request, "idemmail/review_record.html", self._context(
            request, f"Ledger record {record.key}", record=fields, has_payload=bool(record.payload),
            payload=payload, can_view_payload=request.user.has_perm("idemmail.view_payload"), actions=actions,
            payload_url=reverse("admin:idemmail_reviewrecord_record") + "?" + urlencode({"key": key, "payload": 1}),
            list_url=reverse("admin:idemmail_reviewrecord_changelist")))

    def action_view(self, request: HttpRequest, action: str) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        key = request.POST.get("key", "")
        if not is_derived_key(key):  # first: nothing below (the refusal's audit line) sees anything else
            return _not_a_key()
        self._refuse_unless_viewer(request)
        if action not in ACTIONS:
            raise Http404("no such action")
        outcome, perm, _ = ACTIONS[action]
        if not request.user.has_perm(perm):
            audit.warning("idemmail admin: %s on %s refused: %s lacks %s", action, logsafe(key),
                          logsafe(request.user.get_username()), perm)
            raise PermissionDenied
        note = request.POST.get("note", "").strip()
        message_id = request.POST.get("message_id", "").strip() or None
        back = HttpResponseRedirect(reverse("admin:idemmail_reviewrecord_record") + "?" + urlencode({"key": key}))
        actor = f"{request.user.get_username()} (django admin)"
        if action != "forget" and not note:
            messages.error(request, "Say why in the note: it is kept with the record.")
            return back
        try:
            if action == "forget":
                done = "payload erased" if erase(operator(), key) else "nothing to erase (no payload stored)"
            else:
                done = decide(operator(), key, outcome, note=note, actor=actor,
                              message_id=message_id if action == "sent" else None).state.value
                done += " (re-enqueued)" if action == "release" else ""
        except (OperatorError, PayloadKeyError) as exc:
            why = EXIT_CODES[exc.code].split(":")[0] if isinstance(exc, OperatorError) else "payload key missing"
            audit.warning("idemmail admin: %s on %s by %s refused (%s)", action, logsafe(key), logsafe(actor), why)
            messages.error(request, str(exc))
            return back
        audit.info("idemmail admin: %s on %s by %s: %s", action, logsafe(key), logsafe(actor), done)
        messages.success(request, f"{key}: {done}")
        return back


def _not_a_key() -> HttpResponse:
    # Every key the library writes is 64 lower-case hex digits (idemmail_celery.keys): anything else is no
    # record's, and is answered before it reaches the ledger, a permission check or the audit log.
    return HttpResponseBadRequest("not a ledger key: 64 lower-case hex digits", content_type="text/plain")


admin.site.register(ReviewRecord, ReviewQueueAdmin)
