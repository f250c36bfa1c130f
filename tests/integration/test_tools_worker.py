"""What an agent sees from tools whose side effect failed, through a real worker and result backend: the first
call and every repeat get the same ``failed`` or ``review`` outcome, and the body ran once."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import current_app

from examples._stack import celery_worker
from idemmail_celery.ledger import State, from_url

from ..conftest import REDIS_URL
from .conftest import Sink


@pytest.fixture
def tools(ns: str, sink: Sink, worker_env: dict[str, str], tmp_path: Path,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    previous = current_app._get_current_object()
    monkeypatch.setenv("IDEMMAIL_TEST_NS", ns)
    sys.modules.pop("tests.integration.toolsapp", None)
    module = importlib.import_module("tests.integration.toolsapp")
    with celery_worker("tests.integration.toolsapp:app", worker_env, log=tmp_path / "worker.log"):
        yield module
    sys.modules.pop("tests.integration.toolsapp", None)
    previous.set_current()
    sink.r.delete(f"_kombu.binding.q.{ns}")


def test_failed_and_ambiguous_tool_calls_are_replayed_to_the_agent_not_rerun(tools: Any, ns: str) -> None:
    bounced = [tools.bounce({"to": "ann@example.com"}, call_id="call_1", timeout=20) for _ in range(2)]
    assert [o["status"] for o in bounced] == ["failed", "failed"]
    assert bounced[0]["error"] == {"type": "PermanentSendError", "message": "mailbox does not exist",
                                   "reason": "bounced"}
    unsure = [tools.unsure({"to": "ann@example.com"}, call_id="call_2", timeout=20) for _ in range(2)]
    assert [o["status"] for o in unsure] == ["review", "review"]
    assert {o["error"]["type"] for o in unsure} == {"SendNeedsReview"}
    if importlib.util.find_spec("langchain_core"):  # the [langchain] extra: a failed call is an error message
        from idemmail_celery.contrib.langchain import as_langchain_tool

        call = {"type": "tool_call", "name": tools.bounce.name, "args": {"to": "ann@example.com"}, "id": "call_1"}
        message = as_langchain_tool(tools.bounce).invoke(call)
        assert (message.status, json.loads(message.content)["status"]) == ("error", "failed")
        call = {**call, "name": tools.unsure.name, "id": "call_2"}  # review: not an error, a person decides
        assert as_langchain_tool(tools.unsure).invoke(call).status == "success"

    ledger = from_url(REDIS_URL, prefix=f"led.{ns}")
    states = {ledger.get(o["key"]).state for o in (bounced[0], unsure[0])}  # type: ignore[union-attr]
    assert states == {State.FAILED, State.REVIEW}
    assert all(ledger.get(o["key"]).attempts == 1 for o in (bounced[0], unsure[0]))  # type: ignore[union-attr]


def test_a_call_id_that_comes_back_with_other_arguments_is_refused_not_answered_as_the_first(
        tools: Any, ns: str, sink: Sink) -> None:
    first = tools.note({"ticket": "T-1", "text": "a"}, call_id="call_1", timeout=20)
    again = tools.note({"ticket": "T-1", "text": "a"}, call_id="call_1", timeout=20)
    other = tools.note({"ticket": "T-1", "text": "b"}, call_id="call_1", timeout=20)
    assert [first["status"], again["status"]] == ["sent", "duplicate"]
    assert other["status"] == "key_reuse"
    assert other["error"]["type"] == "IdempotencyKeyReuseError"
    assert sink.r.lrange(f"notes.{ns}", 0, -1) == ["T-1:a"]  # the body ran once, for the first call
    sink.r.delete(f"notes.{ns}")
