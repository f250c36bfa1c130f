"""The agent examples, each run as a user would: a scripted agent loop retries and repeats tool calls against a
real worker subprocess (Redis broker, results and ledger), and the fake CRM, Slack and email API count one side
effect each. examples/agent_tools.py calls the tools directly, examples/agent_mcp.py through an MCP client and
``celery idemmail mcp``, examples/agent_langgraph.py through LangGraph's ToolNode."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import redis

from idemmail_celery.ledger import State, from_url

from ..conftest import REDIS_URL, require_module, service_missing, unique
from .conftest import ROOT


@contextlib.contextmanager
def example_run(module: str) -> Iterator[tuple[str, str]]:
    """Run ``python -m examples.<module> --prefix P`` with Redis on loopback; yield its output and P.

    Its run must pass (exit 0, ``RESULT: OK``); its queue and ledger keys are deleted afterwards.
    """
    r = redis.Redis.from_url(REDIS_URL)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)
    prefix = unique(module.replace("_", "")).replace("_", "")
    env = {**os.environ, "CELERY_BROKER_URL": REDIS_URL, "CELERY_RESULT_BACKEND": REDIS_URL,
           "IDEMMAIL_LEDGER_URL": REDIS_URL, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, "-m", f"examples.{module}", "--prefix", prefix], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "RESULT: OK" in out, out
        yield out, prefix
    finally:
        r.delete(*r.scan_iter(f"{prefix}:*", count=1000), f"{prefix}.tools", f"_kombu.binding.{prefix}.tools")


def test_agent_retrying_and_repeating_tool_calls_causes_one_side_effect_each() -> None:
    with example_run("agent_tools") as (out, prefix):
        assert "crm updates: 1\n" in out and "slack posts: 1 ['[INC-42] Resolved: payments are back.']" in out, out
        assert "emails delivered: 1 ['Ticket T-981 is resolved']" in out, out  # the first wording shipped
        tries = re.findall(r"^turn 1 call_1 update_deal try (\d): (\w+)", out, re.MULTILINE)
        assert tries[:2] == [("1", "pending"), ("2", "pending")] and tries[2][1] in ("sent", "duplicate"), out
        # The model tried to pick the recipient: refused, the application bound it to the ticket's customer.
        assert "call_3 send_email try 1: invalid (ToolArgumentError: to)" in out, out
        tries_of = {call: re.findall(rf"^turn \d {call} \w+ try \d: (\w+)", out, re.MULTILINE)
                    for call in ("call_1", "call_2", "call_4", "call_5", "call_6")}
        for call in ("call_5", "call_6"):  # asked again: "pending" while a busy worker catches up, then "duplicate"
            assert tries_of[call][-1] == "duplicate" and set(tries_of[call][:-1]) <= {"pending"}, out
        # Every try is a message of its own; under one intent, at most one of them may report "sent".
        for calls in (("call_1",), ("call_2", "call_5"), ("call_4", "call_6")):
            assert sum(tries_of[call].count("sent") for call in calls) <= 1, out

        keys = json.loads(re.search(r"^keys: (.*)$", out, re.MULTILINE).group(1))  # type: ignore[union-attr]
        assert keys["call_5"] == keys["call_2"] and keys["call_6"] == keys["call_4"]
        ledger = from_url(REDIS_URL, prefix=prefix)
        for call in ("call_1", "call_2", "call_4"):
            record = ledger.get(keys[call])
            assert record is not None and record.state is State.SENT, (call, record)


def test_agent_over_mcp_times_out_calls_again_and_one_email_is_sent() -> None:
    require_module("mcp")
    with example_run("agent_mcp") as (out, _):
        assert 'tools: ["send_email", "crm.add_note", "intent_state"]' in out, out
        assert "send_email try 1: timed out after 1 s" in out, out  # the client gave up; the send went on
        assert "emails delivered: 1 ['Your ticket T-981 is resolved']" in out and "crm notes: 1\n" in out, out
        tries = re.findall(r"^send_email try \d: (.+)$", out, re.MULTILINE)
        assert tries[-1] in ("duplicate", "sent") and tries.count("sent") <= 1, out
        assert "intent_state: sent" in out and "add_note try 2: duplicate" in out, out  # the ledger says sent


def test_langgraph_agent_asks_again_while_pending_and_one_email_is_sent() -> None:
    require_module("langgraph")
    with example_run("agent_langgraph") as (out, _):
        assert "send_email call_1: pending\n" in out, out  # the first wait ran out; the model asked again
        assert "emails delivered: 1 ['Ticket T-981 resolved']" in out and "crm notes: 1\n" in out, out
        assert re.findall(r"^add_note call_2: (\w+)$", out, re.MULTILINE) == ["sent", "duplicate"], out
