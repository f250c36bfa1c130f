"""Issue 35, item 6: no value from outside the library's code can write a log line of its own.

Every log call that shows a key, a task name or id, a message id, an event, a note, a reason, a user
name or an exception's text passes it through :func:`idemmail_celery._common.logsafe`, which leaves
plain text as it is and quotes and escapes anything else: a value with a newline stays on its line.
"""

from __future__ import annotations

import ast
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from idemmail_celery._common import logsafe
from idemmail_celery.errors import LedgerLostError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, from_url
from idemmail_celery.ledger.redis import RedisLedger

from .conftest import REDIS_URL, service_missing, unique

PACKAGE = Path(__file__).resolve().parents[1] / "idemmail_celery"
_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}
_LOGGERS = {"log", "logger", "audit", "self.log"}
#: What a log call may show that comes from outside the library's own code: keys, task names and ids, message
#: and event ids, notes and reasons, who did it, and exceptions (their texts quote stores, providers, callers).
_OUTSIDE = re.compile(r"\b(key|task_name|request\.id|message_id|event_id|campaign_id|note|acked_by|actor|username|"
                      r"get_username|reason|exc|exc_ledger|error|provider|event|other|TopicArn|SubscribeURL)\b")


@pytest.mark.parametrize(("value", "shown"), [
    ("9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
     "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"),
    ("connection refused by the store", "connection refused by the store"),
    ("k\nidemmail admin: release on k2 by root", '"k\\nidemmail admin: release on k2 by root"'),
    ("a\rb", '"a\\rb"'),
    ("a\u2028b", '"a\\x2028b"'),
    ("rtl\u202eevil", '"rtl\\x202eevil"'),
    ('say "hi"', '"say \\"hi\\""'),
    ("back\\slash", '"back\\\\slash"'),
    ("", ""),
    (None, "None"),
    (ValueError("bad\nline"), '"bad\\nline"'),
])
def test_logsafe_leaves_plain_text_and_quotes_anything_that_could_break_a_line(value: object, shown: str) -> None:
    assert logsafe(value) == shown
    assert "\n" not in logsafe(value) and logsafe(value).isprintable()


def _unsafe_log_arguments() -> Iterator[str]:
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _METHODS and ast.unparse(node.func.value) in _LOGGERS):
                continue
            for arg in node.args[2:] if node.func.attr == "log" else node.args[1:]:
                if isinstance(arg, ast.Call) and ast.unparse(arg.func) == "logsafe":
                    continue
                text = ast.unparse(arg)
                if re.fullmatch(r"type\(\w+\)\.__name__", text):  # a class name: the code's own word
                    continue
                if _OUTSIDE.search(text):
                    yield f"{path.relative_to(PACKAGE)}:{node.lineno}: {text}"


def test_every_log_call_passes_outside_values_through_logsafe() -> None:
    assert list(_unsafe_log_arguments()) == []


@pytest.fixture
def prefix() -> Iterator[str]:
    name = unique("logl")
    probe = from_url(REDIS_URL, prefix=name)
    assert isinstance(probe, RedisLedger)
    try:
        probe.client.ping()
    except Exception as exc:
        service_missing("redis", exc)
    yield name
    names = list(probe.client.scan_iter(f"{name}:*", count=1000))
    if names:
        probe.client.delete(*names)
    probe.close()


def test_an_ack_loss_note_with_a_newline_is_one_line_in_every_workers_log(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The note an operator gives `ledger ack-loss` is logged by every worker that adopts the new epoch.
    def req(key: str) -> ClaimRequest:
        return ClaimRequest(key=key, task_name="t.send", payload='{"args":[],"kwargs":{}}', fingerprint="f" * 64)

    worker = from_url(REDIS_URL, prefix=prefix)
    assert isinstance(worker, RedisLedger)
    claim = worker.claim(req("k"))
    worker.complete("k", claim.token, {"message_id": "m"})
    names = list(worker.client.scan_iter(f"{prefix}:*", count=1000))
    worker.client.delete(*names)  # this prefix's keys only: the store "lost" them
    with pytest.raises(LedgerLostError):
        worker.claim(req("k"))
    note = "checked\n[2026-11-27 10:00:00,000: CRITICAL/MainProcess] idemmail: forged"
    from_url(REDIS_URL, prefix=prefix).acknowledge_loss(note=note, actor="ops\nroot")  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="idemmail_celery"):
        assert worker.claim(req("k2")).status is ClaimStatus.ACQUIRED
    adopted = [r.getMessage() for r in caplog.records if "adopting epoch" in r.getMessage()]
    assert len(adopted) == 1 and "\n" not in adopted[0]
    assert adopted[0].endswith(f'acknowledged by "ops\\nroot" ({logsafe(note)})')
