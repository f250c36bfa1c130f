"""Bad input published by name reaches a real worker, which refuses it (issue 24), on the Redis broker.

``delay()`` refuses these calls before anything is enqueued (tests/test_input_limits.py). A publisher
that goes around it (``app.send_task`` by name, another language's client) must meet the same checks at
the worker: the task ends ``FAILURE`` with ``PermanentSendError(reason="invalid_email")``, the ledger
holds no record, the provider receives nothing, and what Flower and the result backend show of the
refusal quotes no address.
"""

from __future__ import annotations

import base64
from typing import Any

from idemmail_celery import PermanentSendError
from idemmail_celery.email import (
    MAX_ATTACHMENTS,
    MAX_FILENAME_CHARS,
    MAX_HEADER_VALUE_CHARS,
    MAX_HEADERS,
    MAX_TAG_CHARS,
    MAX_TAGS,
)
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import FakeProvider

from ..conftest import wait_for
from .conftest import EventTap, results

KIM = {"to": "kim@example.com", "subject": "Your receipt", "text": "Thanks", "event_id": "order-21"}


def _attachment(name: str = "a.txt", content_type: str = "text/plain") -> dict[str, str]:
    return {"filename": name, "content_type": content_type, "content_b64": base64.b64encode(b"x").decode()}


BAD_CALLS = {
    "bidi control in the subject": {**KIM, "subject": "Invoice \u202eGNP.exe"},
    "zero-width space in the address": {**KIM, "to": "ki\u200bm@example.com"},
    "bidi control in an attachment name": {**KIM, "attachments": [_attachment("invoice\u202efdp.exe")]},
    "mixed-script domain": {**KIM, "to": "kim@ex\u0430mple.com"},
    "local part over 64 octets": {**KIM, "to": "k" * 65 + "@example.com"},
    "subject over one line": {**KIM, "subject": "s" * 990},
    "composite MIME attachment": {**KIM, "attachments": [_attachment("m.eml", "message/rfc822")]},
    "too many attachments": {**KIM, "attachments": [_attachment(f"{i}.txt") for i in range(MAX_ATTACHMENTS + 1)]},
    # The bounds of issue 35: each was queued, stored and sent before.
    "attachment name too long": {**KIM, "attachments": [_attachment("n" * (MAX_FILENAME_CHARS + 1))]},
    "too many headers": {**KIM, "headers": {f"X-{i}": "v" for i in range(MAX_HEADERS + 1)}},
    "header value too long": {**KIM, "headers": {"X-Long": "v" * (MAX_HEADER_VALUE_CHARS + 1)}},
    "too many tags": {**KIM, "tags": {f"t{i}": "v" for i in range(MAX_TAGS + 1)}},
    "tag name too long": {**KIM, "tags": {"t" * (MAX_TAG_CHARS + 1): "v"}},
    "tag value too long": {**KIM, "tags": {"t": "v" * (MAX_TAG_CHARS + 1)}},
    "100,000 tags": {**KIM, "tags": {f"t{i}": "v" for i in range(100_000)}},
}


def test_bad_input_published_by_name_is_refused_by_the_worker_and_nothing_is_stored_or_sent(
    fake_app: Any, fake: FakeProvider, start_worker: Any
) -> None:
    start_worker("-P", "prefork", "-c", "2")
    app = fake_app.app
    out = results([app.send_task(TASK_NAME, kwargs=call) for call in BAD_CALLS.values()])
    for what, o in zip(BAD_CALLS, out, strict=True):
        assert isinstance(o, PermanentSendError) and o.reason == "invalid_email", (what, o)
    ledger = app.tasks[TASK_NAME].ledger
    assert list(ledger.iter_records()) == [] and fake.delivery_count() == 0
    # The same worker still sends a good call (nothing above left it stuck or its ledger marked).
    good = results([app.tasks[TASK_NAME].delay(**KIM)])[0]
    assert good["status"] == "sent" and fake.delivery_count() == 1


def test_the_task_failed_event_of_a_refusal_quotes_no_address(
    fake_app: Any, fake: FakeProvider, start_worker: Any, event_tap: EventTap
) -> None:
    """Flower shows a failed task's exception and traceback from its ``task-failed`` event: a refusal that
    names a field shaped like an address (a tag name here) reaches it without the address."""
    start_worker("-P", "prefork", "-c", "1", "-E")
    address = "hidden.person@example.org"
    failed = fake_app.app.send_task(TASK_NAME, kwargs={**KIM, "tags": {f"to {address}": "v"}})
    out = results([failed])[0]
    assert isinstance(out, PermanentSendError) and out.reason == "invalid_email"
    wait_for(lambda: any(e.get("uuid") == failed.id for e in event_tap.of_type("task-failed")), timeout=30)
    event = next(e for e in event_tap.of_type("task-failed") if e.get("uuid") == failed.id)
    shown = f"{event.get('exception', '')}\n{event.get('traceback', '')}"
    assert "PermanentSendError" in shown and address not in shown and "example.org" not in shown
    assert fake.delivery_count() == 0
