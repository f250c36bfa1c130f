"""The ledger's review queue in the Django admin (docs/django.md, "The review queue in the admin"): the list reads
the ledger's own listing (:mod:`.review`); the actions are the CLI's moves, with its rules and refusals.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from ..._common import logsafe
from ...cli import EXIT_CODES, OperatorError, _Ctx, decide, erase
from ...errors import LedgerUnavailableError, PayloadKeyError
from ...keys import Payload, is_derived_key
from ...ledger import Ledger, State
from ...ledger.listing import RecordPage, RecordQuery, Summary, label_of, message_id_of
from ...ledger.sealed import is_sealed
from ...task import IdempotentTask
from .conf import celery_app
from .models import ReviewRecord
from .review import AGES, PER_PAGE, ListRequest, Summaries, hierarchy, iso, readable, row

audit = logging.getLogger("idemmail_celery.audit")

#: action -> (the outcome passed to the CLI's move, the permission it needs, its button)
ACTIONS: dict[str, tuple[str, str, str]] = {
    "sent": ("sent", "idemmail.mark_sent", "Mark sent"),
    "release": ("released", "idemmail.release", "Release for a resend"),
    "failed": ("failed", "idemmail.mark_failed", "Mark failed"),
    "forget": ("forget", "idemmail.forget_payload", "Forget the payload"),
}
#: The actions the list runs on many records at once, with one note: action -> its name in the menu.
BULK_ACTIONS = {"sent": "Resolve as sent", "failed": "Resolve as failed", "release": "Release for a resend"}
#: The most records one bulk action resolves ("select all" on a larger queue: narrow it with the filters).
MAX_BULK = 10_000

_operators: dict[int, _Ctx] = {}
_operators_lock = threading.Lock()
summaries = Summaries()


def operator() -> _Ctx:
    """The CLI's context for the project's Celery app (its ledger opened as the CLI opens it), once per process."""
    app = celery_app()
    with _operators_lock:
        return _operators.setdefault(id(app), _Ctx(app, None, {}))  # a _Ctx opens its ledger on first use


class ReviewQueueAdmin(admin.ModelAdmin):
    """The review queue: a changelist, a record's page, and one POST per action (one record, or many)."""

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
            path("record/<str:action>/", view(require_POST(self.action_view)), name="idemmail_reviewrecord_action"),
        ]

    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {**self.admin_site.each_context(request), "opts": self.opts, "title": title, **extra}

    def _refuse_unless_viewer(self, request: HttpRequest) -> None:
        if not self.has_view_permission(request):
            raise PermissionDenied

    @staticmethod
    def _require(request: HttpRequest, action: str, target: object) -> None:
        """PermissionDenied (and an audit line) unless the user holds ``action``'s permission."""
        perm = ACTIONS[action][1]
        if not request.user.has_perm(perm):
            audit.warning("idemmail admin: %s on %s refused: %s lacks %s", action, target,
                          logsafe(request.user.get_username()), perm)
            raise PermissionDenied

    # -- the list --

    def list_view(self, request: HttpRequest) -> HttpResponse:
        """The changelist as ``request.GET`` asks (see :mod:`.review`); a POST is a bulk action."""
        if request.method == "POST":
            return self.bulk_view(request)
        self._refuse_unless_viewer(request)
        asked = ListRequest.parse(request.GET, time.time())
        listed = _Listing.read(asked)
        bulk = [(name, label) for name, label in BULK_ACTIONS.items() if request.user.has_perm(ACTIONS[name][1])]
        state = asked.query.state
        record_url = reverse("admin:idemmail_reviewrecord_record")
        return TemplateResponse(request, "idemmail/review_list.html", self._context(
            request, "Ledger records" + (f": {state.value}" if state else ""),
            rows=[_row_html(row(r), bool(bulk), record_url) for r in listed.page.records], error=listed.error,
            problems=asked.problems, bulk_actions=bulk, total=listed.summary.total, per_page=PER_PAGE,
            filters=_sidebar(asked, listed.counts, listed.summary, searching=bool(asked.query.search)),
            date_hierarchy=hierarchy(asked, listed.summary.days), media=self.media,
            **_paging(asked, listed.page, listed.summary.total), **_list_links(asked)))

    def bulk_view(self, request: HttpRequest) -> HttpResponse:
        """One action on the rows ticked (or every record the page's filters match), with one note."""
        keys = request.POST.getlist("_selected_action")
        if not all(is_derived_key(k) for k in keys):  # first: nothing below sees anything else
            return _not_a_key()
        self._refuse_unless_viewer(request)
        asked = ListRequest.parse(request.GET, time.time())
        back = HttpResponseRedirect(reverse("admin:idemmail_reviewrecord_changelist") + asked.link(p=asked.page))
        action = request.POST.get("action", "")
        if action not in BULK_ACTIONS:
            messages.error(request, "Choose an action for the records ticked.")
            return back
        across = request.POST.get("select_across") == "1"
        self._require(request, action, f"{'every matching' if across else len(keys)} records")
        note = request.POST.get("note", "").strip()
        if not note:
            messages.error(request, "Say why in the note: it is kept with every record the action resolves.")
            return back
        try:
            if across:
                keys = _every_key(operator().ledger, asked.query)
        except (LedgerUnavailableError, PayloadKeyError) as exc:
            messages.error(request, _failure(exc))
            return back
        if not keys:
            messages.warning(request, "Tick the records to act on first (none was ticked).")
            return back
        done, refused = 0, []
        for key in dict.fromkeys(keys):
            try:
                _act(request, action, key, note, bulk=True)
                done += 1
            except (OperatorError, PayloadKeyError) as exc:
                refused.append(f"Record {key}: {exc}")
        summaries.forget()
        said = f"{BULK_ACTIONS[action]}: {done} of {len(set(keys))} records, the note kept with each."
        (messages.success if done else messages.warning)(request, said)
        for line in refused[:20]:
            messages.error(request, line)
        if len(refused) > 20:
            messages.error(request, f"... and {len(refused) - 20} more refused (the audit log names each).")
        return back

    # -- one record --

    def record_view(self, request: HttpRequest) -> HttpResponse:
        key = request.GET.get("key", "")
        if not is_derived_key(key):
            return _not_a_key()
        self._refuse_unless_viewer(request)
        show_payload = request.GET.get("payload") == "1" and request.user.has_perm("idemmail.view_payload")
        try:
            record = operator().ledger.get(key)
        except (LedgerUnavailableError, PayloadKeyError) as exc:
            messages.error(request, _failure(exc))
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
            fields[name] = json.dumps(readable(fields[name]), indent=2, sort_keys=True, default=str) \
                if fields[name] else ""
        for name in ("created_at", "updated_at", "expires_at", "lease_expires_at"):
            fields[name] = iso(fields[name])
        fields["label"], fields["message_id"] = str(label_of(record)), message_id_of(record)
        actions = [{"name": name, "label": label} for name, (_, perm, label) in ACTIONS.items()
                   if request.user.has_perm(perm)]
        return TemplateResponse(request, "idemmail/review_record.html", self._context(
            request, f"Ledger record {record.key}", record=fields, has_payload=bool(record.payload),
            payload=payload, can_view_payload=request.user.has_perm("idemmail.view_payload"), actions=actions,
            payload_url=reverse("admin:idemmail_reviewrecord_record") + "?" + urlencode({"key": key, "payload": 1}),
            list_url=reverse("admin:idemmail_reviewrecord_changelist")))

    def action_view(self, request: HttpRequest, action: str) -> HttpResponse:
        key = request.POST.get("key", "")
        if not is_derived_key(key):  # first: nothing below (the refusal's audit line) sees anything else
            return _not_a_key()
        self._refuse_unless_viewer(request)
        if action not in ACTIONS:
            raise Http404("no such action")
        self._require(request, action, logsafe(key))
        note = request.POST.get("note", "").strip()
        back = HttpResponseRedirect(reverse("admin:idemmail_reviewrecord_record") + "?" + urlencode({"key": key}))
        if action != "forget" and not note:
            messages.error(request, "Say why in the note: it is kept with the record.")
            return back
        try:
            done = _act(request, action, key, note, message_id=request.POST.get("message_id", "").strip() or None)
        except (OperatorError, PayloadKeyError) as exc:
            messages.error(request, f"Record {key}: {exc}")
            return back
        summaries.forget()
        messages.success(request, f"Record {key}: {done}")  # "Record" first: the admin capitalises a message
        return back


def _act(request: HttpRequest, action: str, key: str, note: str, *, message_id: str | None = None,
         bulk: bool = False) -> str:
    """Run ``action`` on ``key`` as the CLI does, with its audit line; what was done. The CLI's refusal
    (:class:`~idemmail_celery.cli.OperatorError`) or a missing payload key is audited, and raised."""
    actor = f"{request.user.get_username()} (django admin)"
    try:
        if action == "forget":
            done = "payload erased" if erase(operator(), key) else "nothing to erase (no payload stored)"
        else:
            done = decide(operator(), key, ACTIONS[action][0], note=note, actor=actor,
                          message_id=message_id if action == "sent" else None).state.value
            done += " (re-enqueued)" if action == "release" else ""
    except (OperatorError, PayloadKeyError) as exc:
        why = EXIT_CODES[exc.code].split(":")[0] if isinstance(exc, OperatorError) else "payload key missing"
        audit.warning("idemmail admin: %s on %s by %s refused (%s%s)", action, logsafe(key), logsafe(actor), why,
                      "; bulk" if bulk else "")
        raise
    audit.info("idemmail admin: %s on %s by %s: %s%s", action, logsafe(key), logsafe(actor), done,
               " (bulk)" if bulk else "")
    return done


def _failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _row_html(r: dict[str, Any], tick: bool, record_url: str) -> SafeString:
    """One row of the list, built here (a hundred rows through template tags cost more than the ledger's calls)."""
    said = format_html('<span title="provider message id">{}</span>', r["said"]) if r["said_is_message_id"] \
        else r["said"]
    tick_box = format_html('<td class="action-checkbox"><input type="checkbox" name="_selected_action" value="{}" '
                           'class="action-select" aria-label="Select {}"></td>', r["key"], r["key"]) if tick else ""
    return format_html(
        '<tr class="idemmail-record">{}<th><a href="{}?{}" class="idemmail-key">{}<wbr>{}</a></th>'
        '<td class="idemmail-label">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>'
        '<td class="idemmail-when">{}</td></tr>', tick_box, record_url, urlencode({"key": r["key"]}), r["key"][:32],
        r["key"][32:], r["label"] or "-", r["state"], r["task_name"] or "-", said or "-", r["attempts"], r["when"])


@dataclass
class _Listing:
    """What the list page read from the ledger, or the error that stopped the reading (shown on an empty page)."""

    counts: dict[str, int] = field(default_factory=dict)
    summary: Summary = field(default_factory=lambda: Summary(None))
    page: RecordPage = field(default_factory=lambda: RecordPage([], None))
    error: str | None = None

    @classmethod
    def read(cls, asked: ListRequest) -> _Listing:
        listed = cls()
        try:
            ledger = operator().ledger
            listed.counts = summaries.states(ledger)
            listed.summary, listed.page = _summary_and_page(ledger, asked)
            if listed.counted_too_early(asked):
                summaries.forget()  # counted before these records came: count again
                listed.counts, listed.summary = summaries.states(ledger), summaries.get(ledger, asked.query)
        except (LedgerUnavailableError, PayloadKeyError) as exc:
            listed.error = _failure(exc)
        return listed

    def counted_too_early(self, asked: ListRequest) -> bool:
        """Do the kept counts say fewer records than this page (and those before it) show?"""
        total = self.summary.total
        shown = (asked.page - 1) * PER_PAGE + len(self.page.records)
        return total is not None and (shown > total or bool(self.page.next_cursor and shown >= total))


def _summary_and_page(ledger: Ledger, asked: ListRequest) -> tuple[Summary, RecordPage]:
    """The summary kept, else counted in a thread of its own while the page is read: on Redis the web process's
    half of each pass runs while the store works on the other's, so a first render costs about the longer one."""
    kept = summaries.kept(ledger, asked.query)
    if kept is not None:
        return kept, _page(ledger, asked)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="idemmail-count") as pool:
        counting = pool.submit(summaries.get, ledger, asked.query)
        page = _page(ledger, asked)
        return counting.result(), page


def _paging(asked: ListRequest, page: RecordPage, total: int | None) -> dict[str, Any]:
    """The list's pagination: the page numbers (elided, as Django's), the rows' numbers, previous and next."""
    pages = None
    if total is not None and total > PER_PAGE:
        paginator = Paginator(range(total), PER_PAGE)
        numbers = paginator.get_elided_page_range(min(asked.page, paginator.num_pages), on_each_side=2, on_ends=1)
        pages = [{"number": n, "link": asked.link(p=n) if isinstance(n, int) and n != asked.page else ""}
                 for n in numbers]
    before = (asked.page - 1) * PER_PAGE
    return {"page": asked.page, "pages": pages, "first": before + 1 if page.records else 0,
            "last": before + len(page.records),
            "next_link": asked.link(p=asked.page + 1, c=page.next_cursor) if page.next_cursor else "",
            "previous_link": asked.link(p=asked.page - 1 if asked.page > 2 else None) if asked.page > 1 else ""}


def _list_links(asked: ListRequest) -> dict[str, Any]:
    """The search box, the order toggle and the "clear all filters" link, each keeping the other parameters."""
    unfiltered = {k: None for k in asked.params if k not in ("state", "o")}
    return {"search": asked.params.get("q", ""), "search_hidden": [(k, v) for k, v in asked.params.items() if k != "q"],
            "clear_search_link": asked.link(q=None), "newest_first": asked.query.newest_first,
            "order_link": asked.link(o=None if asked.query.newest_first else "-updated"),
            "clear_link": asked.link(**unfiltered) if asked.filtered else ""}


def _page(ledger: Ledger, asked: ListRequest) -> RecordPage:
    """The page asked for: after the cursor the "next" link carries, else by its number from the start."""
    if asked.cursor:
        try:
            return ledger.list_records(asked.query, cursor=asked.cursor, limit=PER_PAGE)
        except ValueError:
            pass  # a cursor of another order (or none of ours): by the page's number
    return ledger.list_records(asked.query, offset=(asked.page - 1) * PER_PAGE, limit=PER_PAGE)


def _every_key(ledger: Ledger, query: RecordQuery) -> list[str]:
    """The keys of every record ``query`` matches ("select all"), at most :data:`MAX_BULK`."""
    keys: list[str] = []
    cursor = None
    while len(keys) < MAX_BULK:
        page = ledger.list_records(query, cursor=cursor, limit=min(500, MAX_BULK - len(keys)))
        keys += [r.key for r in page.records]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    return keys


def _sidebar(asked: ListRequest, counts: dict[str, int], summary: Summary, *, searching: bool) -> list[dict[str, Any]]:
    """The filters: each a title and its choices (a label, a link keeping the other filters, whether chosen)."""
    def shown(label: str, n: int | None) -> str:  # a search's counts are not the filter's
        return f"{label} ({n:,})" if n is not None and not searching else label

    def choice(label: str, param: str, value: str | None, n: int | None = None) -> dict[str, Any]:
        return {"display": shown(label, n), "link": asked.link(**{param: value}),
                "selected": asked.params.get(param) == value}

    state = asked.params.get("state", State.REVIEW.value)
    per_state = {"all": sum(counts.values()), **{s.value: counts.get(s.value, 0) for s in State}}
    out = [{"title": "state", "choices": [{"display": f"{name} ({n:,})", "link": asked.link(state=name),
                                           "selected": state == name} for name, n in per_state.items()]}]
    reasons = dict(summary.reasons or {})
    tasks = dict(summary.tasks) if summary.tasks is not None else dict.fromkeys(_app_tasks(), None)
    for param, found in (("reason", reasons), ("task", tasks)):
        chosen = asked.params.get(param)
        if chosen and chosen not in found:
            found[chosen] = 0
        choices = [choice("All", param, None)]
        for value, n in sorted(found.items(), key=lambda kv: (-(kv[1] or 0), kv[0])):
            if value:
                choices.append(choice(value, param, value, n))
            else:  # records without one: counted, not a filter of their own
                choices.append({"display": shown("(none)", n), "link": "", "selected": False})
        out.append({"title": param, "choices": choices})
    out.append({"title": "age", "choices": [choice("Any time", "age", None)] + [
        choice(label, "age", name) for name, (label, _, _) in AGES.items()]})
    return out


def _app_tasks() -> list[str]:
    """The project's idempotent tasks: the task filter's choices where the ledger cannot count them."""
    try:
        return sorted(name for name, task in celery_app().tasks.items() if isinstance(task, IdempotentTask))
    except Exception:  # an app not finalised, or none: no choices but "All"
        return []


def _not_a_key() -> HttpResponse:
    # Answered before anything reaches the ledger, a permission check or the audit log.
    return HttpResponseBadRequest("not a ledger key: 64 lower-case hex digits", content_type="text/plain")


admin.site.register(ReviewRecord, ReviewQueueAdmin)
