"""``make demo`` keeps working: examples/demo.py runs a real worker, kills pool children, injects provider
faults, and every intent is still delivered exactly once."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def report_number(out: str, label: str) -> int:
    """The number on the report line that starts with ``label`` (e.g. ``provider deliveries   300``)."""
    match = re.search(rf"^\s+{re.escape(label)}\s+(\d+)\b", out, re.MULTILINE)
    assert match, f"no {label!r} line in the report:\n{out}"
    return int(match.group(1))


@pytest.mark.worker
def test_demo_sends_each_intent_once() -> None:
    proc = subprocess.Popen(
        # One plan every run; 200 intents (make demo's default is 300): the same kills and faults, a shorter run.
        [sys.executable, str(ROOT / "examples" / "demo.py"), "--seed", "7", "--intents", "200"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        # SIGINT, not SIGKILL: the demo stops the worker it started (its own process group) on the way out.
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"the demo took more than 180 s:\n{out}\n--- stderr ---\n{err[-3000:]}") from None
    everything = f"{out}\n--- stderr ---\n{err[-3000:]}"
    assert proc.returncode == 0, everything
    assert "\r" not in err, everything  # its stderr is a pipe here, as in a CI log: plain lines, no redrawn bar
    assert "RESULT: OK" in out, everything

    intents = report_number(out, "intents")
    assert intents >= 200, everything
    assert report_number(out, "provider deliveries") == intents, everything
    assert report_number(out, "enqueued messages") == 3 * intents, everything
    assert report_number(out, "reviews") == 0, everything
    assert report_number(out, "pool children killed") >= 2, everything
    assert report_number(out, "faults injected") > 0, everything
    assert f"distinct intents delivered: {intents}, delivered more than once: 0" in out, everything
    assert re.search(rf"^\s+first body shipped\s+{intents}/{intents}\b", out, re.MULTILINE), everything


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_demos_progress_bar_is_redrawn_on_a_terminal_and_plain_lines_elsewhere() -> None:
    from examples.demo import Progress

    def shown(stream: io.StringIO) -> str:
        progress = Progress(stream)
        for done in range(201):
            progress.show(done, 200, "n intents settled")
        progress.close()
        return stream.getvalue()

    log = shown(io.StringIO())
    assert "\r" not in log
    assert len(log.splitlines()) == 11 and log.splitlines()[-1].startswith(f"[{'#' * 30}] 200/200 messages")
    terminal = shown(_Terminal())
    assert terminal.count("\r") == 201 and terminal.count("\n") == 1 and terminal.endswith("\n")
