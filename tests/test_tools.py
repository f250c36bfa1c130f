"""idemmail_celery.tools without a worker: what the model is shown, where keys come from, what is refused.

The end-to-end proof (an agent loop retrying against a real worker, one side effect) is
tests/integration/test_examples_agent.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from idemmail_celery import ConfigurationError
from idemmail_celery.tools import email_tool, idempotent_tool, parameters_of

from .conftest import unique


@pytest.fixture
def app() -> Celery:
    app = Celery(unique("tools"), broker="memory://", backend="cache+memory://")
    app.conf.update(idemmail_key_secret="test-secret", idemmail_provider_url="console://",
                    idemmail_default_from="Support <support@example.com>", task_serializer="json")
    return app


@pytest.fixture
def published() -> Iterator[list[str]]:
    seen: list[str] = []

    def count(sender: Any = None, **_: Any) -> None:
        seen.append(str(sender))

    before_task_publish.connect(count, weak=False)
    yield seen
    before_task_publish.disconnect(count)


def test_spec_shows_the_model_a_schema_from_type_hints_without_bound_fields(app: Celery) -> None:
    @idempotent_tool(app, key=("channel", "incident_id"), name=unique("post"))
    def post_status(channel: str, incident_id: str, text: str, urgent: bool = False, tags: list[str] | None = None
                    ) -> dict[str, Any]:
        """Post a status update.

        Longer text the model does not need.
        """
        return {}

    spec = post_status.spec()
    assert spec["name"] == "post_status" and spec["description"] == "Post a status update."
    assert spec["input_schema"] == {
        "type": "object",
        "properties": {"channel": {"type": "string"}, "incident_id": {"type": "string"}, "text": {"type": "string"},
                       "urgent": {"type": "boolean"}, "tags": {"type": "array"}},
        "required": ["channel", "incident_id", "text"],
    }
    bound = post_status.bind(channel="#ops")
    assert "channel" not in bound.spec()["input_schema"]["properties"]
    assert bound.spec()["input_schema"]["required"] == ["incident_id", "text"]
    assert "channel" in post_status.spec()["input_schema"]["properties"]  # bind returned a copy


def test_bound_method_schema_skips_self() -> None:
    def update(self: Any, deal_id: str, stage: int) -> None: ...

    assert parameters_of(update, bound=True)["properties"] == {"deal_id": {"type": "string"},
                                                               "stage": {"type": "integer"}}


def test_call_id_key_follows_the_call_id_and_declared_fields_ignore_free_text(app: Celery) -> None:
    @idempotent_tool(app, key="call_id", name=unique("deal"))
    def update_deal(deal_id: str, stage: str) -> None: ...

    @idempotent_tool(app, key=("channel", "incident_id"), name=unique("post"))
    def post_status(channel: str, incident_id: str, text: str) -> None: ...

    args = {"deal_id": "D-7", "stage": "won"}
    assert update_deal.key_for(args, call_id="call_1") == update_deal.key_for({**args, "stage": "lost"},
                                                                              call_id="call_1")
    assert update_deal.key_for(args, call_id="call_1") != update_deal.key_for(args, call_id="call_2")
    assert update_deal.key_for(args) == update_deal.key_for(dict(args))  # no call id: all arguments

    first = post_status.key_for({"channel": "#ops", "incident_id": "INC-1", "text": "Resolved."}, call_id="a")
    reworded = post_status.key_for({"channel": "#ops", "incident_id": "INC-1", "text": "All fine now."}, call_id="b")
    other = post_status.key_for({"channel": "#ops", "incident_id": "INC-2", "text": "Resolved."}, call_id="a")
    assert first == reworded != other


def test_email_tool_key_is_the_bound_event_not_the_text(app: Celery) -> None:
    reply = email_tool(app).bind(event_id="ticket-9-resolved", template="ticket_reply")
    assert "event_id" not in reply.spec()["input_schema"]["properties"]
    one = reply.key_for({"to": "Ann <ann@Example.com>", "subject": "Resolved", "text": "Fixed."}, call_id="c1")
    two = reply.key_for({"to": "ann@example.com", "subject": "Re: resolved", "text": "Fixed, really."}, call_id="c2")
    assert one == two


def test_refused_calls_are_reported_to_the_agent_and_nothing_is_enqueued(app: Celery, published: list[str]) -> None:
    @idempotent_tool(app, name=unique("deal"))
    def update_deal(deal_id: str, stage: str) -> None: ...

    bad_email = email_tool(app)({"to": "ann@@example.com", "subject": "Hi", "text": "x", "event_id": "e1"},
                                call_id="c1")
    assert bad_email["status"] == "invalid"
    assert bad_email["error"]["type"] == "InvalidEmail" and bad_email["error"]["field"] == "to"
    unknown_argument = update_deal({"deal_id": "D-7", "stage": "won", "owner": "bob"}, call_id="c2")
    assert unknown_argument["status"] == "invalid" and unknown_argument["key"] is None
    assert published == []


def test_a_tool_without_a_result_backend_or_with_a_bad_key_is_a_configuration_error() -> None:
    app = Celery(unique("nobackend"), broker="memory://")
    app.conf.idemmail_key_secret = "test-secret"

    @idempotent_tool(app, name=unique("deal"))
    def update_deal(deal_id: str) -> None: ...

    with pytest.raises(ConfigurationError, match="result backend"):
        update_deal({"deal_id": "D-7"}, call_id="c1")
    with pytest.raises(ConfigurationError, match="call_id"):
        idempotent_tool(app, key="deal_id")
