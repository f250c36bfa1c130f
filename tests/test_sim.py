"""The simulator's own checks (sim/, docs/guarantee.md): its in-memory ledger honours the ledger contract
(the contract suite runs against it), each planted defect is caught, each saved trace replays without a
violation, and a short exploration of every world finds none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from idemmail_celery.ledger import Ledger
from sim.defects import DEFECTS, planted
from sim.explore import exhaustive, hunt, load, replay, run, simulating, walker
from sim.ledger import MemLedger
from sim.world import Config
from sim.worlds import EXHAUSTIVE, RANDOM

from . import test_ledger_contract as contract

TRACES = sorted((Path(__file__).parent.parent / "sim" / "traces").glob("*.json"))
#: Defects the simulator found that are not fixed yet (see test_each_open_defect_trace_still_breaks).
OPEN = sorted((Path(__file__).parent.parent / "sim" / "traces" / "open").glob("*.json"))

#: The contract tests that need no particular store: the rest start processes or open URLs.
CONTRACT = [getattr(contract, name) for name in dir(contract) if name.startswith("test_") and name not in (
    "test_retention_expiry_and_purge", "test_concurrent_reclaim_exactly_one_wins",
    "test_concurrent_processes_exactly_one_wins", "test_namespaces_do_not_collide",
    "test_keep_payload_keeps_it_after_sent_for_audit", "test_a_task_id_cannot_spell_the_write_ahead_promise")]


@pytest.fixture
def memory() -> Iterator[Ledger]:
    yield MemLedger(time.time)


@pytest.mark.parametrize("test", CONTRACT, ids=lambda t: t.__name__)
def test_the_in_memory_ledger_honours_the_contract(test: object, memory: Ledger,
                                                   request: pytest.FixtureRequest) -> None:
    marks = getattr(test, "pytestmark", [])
    params = next((m.args for m in marks if m.name == "parametrize"), None)
    if params is None:
        test(memory)  # type: ignore[operator]
        return
    for value in params[1]:
        test(MemLedger(time.time), value)  # type: ignore[operator]


@pytest.mark.parametrize("defect", DEFECTS, ids=lambda d: d.name)
def test_each_planted_defect_is_caught_within_a_minute(defect: object) -> None:
    assert hasattr(defect, "worlds")
    with simulating(), planted(defect):  # type: ignore[arg-type]
        found = hunt(defect.worlds, seconds=60.0)
    assert found is not None, f"the simulator missed {defect.name}"  # type: ignore[attr-defined]


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.stem)
def test_each_saved_trace_replays_without_a_violation(trace: Path) -> None:
    cfg, choices, data = load(trace)
    with simulating():
        out = replay(cfg, choices)
    assert out.violations == [], f"{trace.name} ({data['violations']}) breaks again"


def test_each_open_defect_trace_still_breaks() -> None:
    """Defects the simulator found that are not fixed yet (``sim/traces/open/``, each told in the README there)
    are expected failures: once one is fixed its trace passes, and belongs in ``sim/traces/``. None at present."""
    for trace in OPEN:
        cfg, choices, _ = load(trace)
        with simulating():
            out = replay(cfg, choices)
        assert out.violations, f"{trace.name} no longer breaks: its defect is fixed, move it up to sim/traces/"


def test_a_saved_trace_breaks_again_when_its_fix_is_taken_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The traces are worth keeping: without the fix they record, they break."""
    from dataclasses import replace

    def erase_as_it_was(self: MemLedger, key: str, expected_token: int, expected_state: object,
                        result: object, error: object) -> bool:
        seen = self.records.get(key)
        if seen is None or seen.token != expected_token:
            return False  # fenced by the token alone, the error as read written over a mark written since
        self.records[key] = replace(seen, payload=None, result=result, error=error)  # type: ignore[arg-type]
        return True

    monkeypatch.setattr(MemLedger, "_erase", erase_as_it_was)
    cfg, choices, _ = load(next(p for p in TRACES if p.stem == "forget_races_a_write_ahead_mark"))
    with simulating():
        assert replay(cfg, choices).violations


def test_a_short_exploration_of_every_world_finds_no_violation() -> None:
    with simulating():
        for cfg in EXHAUSTIVE:
            for out in exhaustive(cfg, limit=15):
                assert out.violations == [], (cfg, out.choices)
        for n, cfg in enumerate(RANDOM):
            out = run(cfg, walker(n))
            assert out.violations == [], (cfg, n, out.choices)


def test_a_schedule_replays_to_the_same_steps() -> None:
    cfg = Config(provider="smtp", copies=3, faults=4, crashes=1, stalls=1, ticks=2, steps=80)
    with simulating():
        first = run(cfg, walker(7), keep=True)
        again = replay(cfg, first.choices, keep=True)
    assert again.log == first.log and again.violations == first.violations
