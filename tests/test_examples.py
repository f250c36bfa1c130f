"""``make demo`` keeps working: examples/demo.py runs a real worker on files only and checks its counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_sends_each_intent_once() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "order 1001: 1 sent, 2 duplicate" in out, out
    assert "outbox.jsonl: 2 lines" in out, out
    assert "outbox.jsonl: 1 line for this intent; ledger state: review" in out, out
    assert "RESULT: OK" in out and "3 intents, 3 outbox lines" in out, out
