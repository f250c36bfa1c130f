"""idemmail_celery.tools without a worker: what the model is shown, where keys come from, what is refused.

The end-to-end proof (an agent loop retrying against a real worker, one side effect) is
tests/integration/test_examples_agent.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import DuplicateTaskNameWarning
from celery.signals import before_task_publish

from idemmail_celery import ConfigurationError
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.tools import ToolArgumentError, app_tools, email_tool, idempotent_tool, parameters_of

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
    @idempotent_tool(app, key=("channel", "incident_id"))
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
        "additionalProperties": False,
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
    @idempotent_tool(app, key="call_id")
    def update_deal(deal_id: str, stage: str) -> None: ...

    @idempotent_tool(app, key=("channel", "incident_id"))
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
    @idempotent_tool(app)
    def update_deal(deal_id: str, stage: str) -> None: ...

    bad_email = email_tool(app).bind(event_id="e1")({"to": "ann@@example.com", "subject": "Hi", "text": "x"},
                                                    call_id="c1")
    assert bad_email["status"] == "invalid"
    assert bad_email["error"]["type"] == "InvalidEmail" and bad_email["error"]["field"] == "to"
    unknown_argument = update_deal({"deal_id": "D-7", "stage": "won", "owner": "bob"}, call_id="c2")
    assert unknown_argument["status"] == "invalid" and unknown_argument["key"] is None
    assert unknown_argument["error"]["type"] == "ToolArgumentError" and unknown_argument["error"]["field"] == "owner"
    missing = update_deal({"deal_id": "D-7"}, call_id="c3")
    assert missing["status"] == "invalid" and missing["error"]["field"] == "stage"
    bound = update_deal.bind(deal_id="D-7")({"deal_id": "D-8", "stage": "won"}, call_id="c4")  # not the model's
    assert bound["status"] == "invalid" and bound["error"]["field"] == "deal_id"
    assert update_deal(["D-7", "won"], call_id="c5")["status"] == "invalid"  # type: ignore[arg-type]
    assert published == []


APP_ONLY = {"bcc": "attacker@evil.example", "cc": "attacker@evil.example", "from_": "CEO <ceo@example.com>",
            "tenant": "other-tenant", "template": "other", "event_id": "ticket-9-resolved-again",
            "headers": {"X-Priority": "1"}, "tags": {"a": "b"},
            "attachments": [{"filename": "a.txt", "content": "eA=="}], "owner": "bob"}


@pytest.mark.parametrize("name", sorted(APP_ONLY))
def test_email_tool_refuses_what_only_the_app_may_set_and_enqueues_nothing(
        app: Celery, published: list[str], name: str) -> None:
    """A prompt-injected model cannot copy the mail elsewhere, spoof the sender or change the intent key."""
    reply = email_tool(app).bind(event_id="ticket-9-resolved", template="ticket_reply")
    args = {"to": "ann@example.com", "subject": "Resolved", "text": "Fixed.", name: APP_ONLY[name]}
    outcome = reply(args, call_id="c1")
    assert outcome["status"] == "invalid" and outcome["key"] is None, outcome
    assert outcome["error"] == {"type": "ToolArgumentError", "field": name, "message": outcome["error"]["message"]}
    assert repr(name) in outcome["error"]["message"]
    with pytest.raises(ToolArgumentError):
        reply.key_for(args, call_id="c1")
    assert published == []  # before_task_publish never fired: no message for the worker
    assert name not in reply.spec()["input_schema"]["properties"]


def test_email_tool_key_is_what_the_app_bound_whatever_the_model_may_set(app: Celery) -> None:
    fixed = {"event_id": "ticket-9-resolved", "template": "ticket_reply", "tenant": "acme", "cc": "desk@example.com",
             "from_": "Support <support@example.com>"}
    reply = email_tool(app).bind(**fixed)
    spec = reply.spec()["input_schema"]
    assert set(spec["properties"]) == {"to", "subject", "text", "html", "reply_to"}
    assert spec["required"] == ["to", "subject"] and spec["additionalProperties"] is False
    assert set(email_tool(app).spec()["input_schema"]["properties"]) == {"to", "subject", "text", "html",
                                                                         "reply_to"}  # never tenant, bcc, from_
    key = reply.key_for({"to": "ann@example.com", "subject": "Resolved", "text": "Fixed."})
    assert key == app.tasks[TASK_NAME].intent_key(to="ann@example.com", **fixed)
    for wording in ({"subject": "Re: resolved", "html": "<p>Fixed</p>"}, {"text": "Really.", "reply_to": "x@e.com"}):
        assert reply.key_for({"to": "Ann <ann@Example.com>", "subject": "Resolved", **wording}, call_id="c9") == key
    other_tenant = email_tool(app).bind(**{**fixed, "tenant": "globex"})  # the app's tenant counts
    assert other_tenant.key_for({"to": "ann@example.com", "subject": "Resolved", "text": "Fixed."}) != key


def test_a_tool_without_a_result_backend_or_with_a_bad_key_is_a_configuration_error() -> None:
    app = Celery(unique("nobackend"), broker="memory://")
    app.conf.idemmail_key_secret = "test-secret"

    @idempotent_tool(app)
    def update_deal(deal_id: str) -> None: ...

    with pytest.raises(ConfigurationError, match="result backend"):
        update_deal({"deal_id": "D-7"}, call_id="c1")
    with pytest.raises(ConfigurationError, match="call_id"):
        idempotent_tool(app, key="deal_id")


def test_app_tools_are_the_email_tool_and_every_tool_made_on_the_app_in_order(app: Celery) -> None:
    other = Celery(unique("other"), broker="memory://", backend="cache+memory://")

    @idempotent_tool(app)
    def update_deal(deal_id: str) -> None: ...

    @idempotent_tool(other)
    def elsewhere(deal_id: str) -> None: ...

    @idempotent_tool(app, name="ops.post_status")
    def post_status(text: str) -> None: ...

    served = app_tools(app)
    assert [t.name for t in served] == ["send_email", "update_deal", "ops.post_status"]
    assert served[0].spec() == email_tool(app).spec() and served[1] is update_deal

    @idempotent_tool(app, name="send_email")
    def send_email(to: str) -> None: ...

    with pytest.raises(ConfigurationError, match="send_email"):
        app_tools(app)


def test_a_second_function_under_a_tool_name_taken_on_the_app_is_refused(app: Celery) -> None:
    @idempotent_tool(app, name="crm.add_note")
    def add_note(deal_id: str) -> None: ...

    with pytest.raises(ConfigurationError, match="already declared"):  # Celery would keep running the first
        @idempotent_tool(app, name="crm.add_note")
        def add_note_again(deal_id: str, text: str) -> None: ...

    @idempotent_tool(app)
    def update(deal_id: str) -> None: ...

    with pytest.raises(ConfigurationError, match="already declared"):  # named after the function, as the first
        @idempotent_tool(app)
        def update(deal_id: str, text: str) -> None: ...

    for bad in ("crm add note", "", "x" * 129, "notiz_über"):
        with pytest.raises(ConfigurationError, match="128 letters"):
            idempotent_tool(app, name=bad)


def test_a_tool_is_its_apps_alone_so_an_app_made_later_gets_no_second_callable_under_its_name() -> None:
    # Celery's app.task is shared by default: each app finalized later gets the function too, and a module
    # imported again (as the worker tests' fixtures do) brought a second function under the same name.
    def declare() -> Celery:
        app = Celery(unique("owner"), broker="memory://", backend="cache+memory://")

        @idempotent_tool(app, name="crm.add_note")
        def add_note(deal_id: str) -> None: ...

        app.finalize()
        return app

    first, again = declare(), declare()
    assert "crm.add_note" in first.tasks and "crm.add_note" in again.tasks
    later = Celery(unique("later"), broker="memory://")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DuplicateTaskNameWarning)
        later.finalize()
    assert "crm.add_note" not in later.tasks
