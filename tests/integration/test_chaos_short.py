"""The short chaos run (the long one is ``make chaos``): real Redis broker, three prefork workers
(``-c 2``) being SIGKILLed, a faulty provider, every intent enqueued three times.

The verdict comes from the provider's own delivery records and the ledger (see
:mod:`chaos.scenario`), never from the workers' return values. Each run writes its event log
(every kill and fault) under the test's ``tmp_path``; a failure names it, with the seed.
Set ``CHAOS_SEED`` to replay a seed (the interleaving, faults and kill choices; not the timing).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from chaos.scenario import POSTGRES_URL, REDIS_URL, Result, Scenario, run_scenario

from ..conftest import service_missing

SEED = int(os.environ.get("CHAOS_SEED") or random.randrange(1 << 30))


@pytest.fixture(autouse=True)
def _needs_redis() -> None:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.ConnectionError as exc:
        service_missing("redis", exc)


def explain(r: Result) -> str:
    s = r.scenario
    return (f"{s.name} (seed {s.seed}): {'; '.join(r.problems) or 'ok'}; deliveries={r.deliveries} "
            f"duplicates={r.duplicates} missing={r.missing} states={r.states} kills={r.child_kills}+{r.worker_kills}w "
            f"faults={r.faults_by_kind}; event log {r.log_dir}/events.jsonl")


@pytest.mark.timeout(170)
def test_keyed_provider_under_kills_and_faults_delivers_every_intent_exactly_once(tmp_path: Path) -> None:
    # visibility_timeout 1 s and slow sends of 2 s: the broker hands running tasks to other workers too.
    s = Scenario(name="short-keyed-vt", intents=200, copies=3, workers=3, kills=6, kill_interval=1.0,
                 fault_rate=0.08, enqueue_seconds=4.0, lease=3.0, visibility_timeout=1.0, provider_timeout=2.5,
                 slow_seconds=2.0, deadline=120.0, seed=SEED)
    r = run_scenario(s, tmp_path / s.name)
    print(explain(r))
    assert r.ok, explain(r)
    assert r.deliveries == s.intents and r.duplicates == 0 and r.missing == 0
    assert r.states == {"sent": s.intents}, explain(r)
    assert r.kills >= 1 and r.faults >= 1, "the run must actually have been disturbed: " + explain(r)
    assert r.overlapping >= 1, "no task outlived visibility_timeout into a second worker: " + explain(r)


@pytest.mark.timeout(170)
def test_keyless_provider_under_kills_and_faults_never_delivers_twice_and_parks_the_rest(tmp_path: Path) -> None:
    s = Scenario(name="short-keyless", provider="http-keyless", intents=200, copies=3, workers=3, kills=6,
                 kill_interval=1.0, fault_rate=0.05, enqueue_seconds=4.0, lease=3.0, visibility_timeout=5.0,
                 provider_timeout=1.0, slow_seconds=1.5, deadline=120.0, seed=SEED + 1)
    r = run_scenario(s, tmp_path / s.name)
    print(explain(r))
    assert r.ok, explain(r)
    assert r.duplicates == 0
    assert r.undelivered_not_review == 0, "an intent was neither delivered nor parked: " + explain(r)
    assert r.deliveries + (r.reviews - r.reviews_delivered) == s.intents, explain(r)
    assert r.kills >= 1 and r.faults >= 1, "the run must actually have been disturbed: " + explain(r)


@pytest.mark.timeout(170)
def test_smtp_without_key_support_on_the_postgresql_ledger_never_delivers_twice(tmp_path: Path) -> None:
    engine = sa.create_engine(POSTGRES_URL, connect_args={"connect_timeout": 5})
    try:
        engine.connect().close()
    except sa.exc.OperationalError as exc:
        service_missing("postgresql", exc)
    finally:
        engine.dispose()
    s = Scenario(name="short-smtp-pg", provider="smtp", ledger="postgresql", intents=200, copies=3, workers=3,
                 kills=5, kill_interval=1.0, fault_rate=0.05, enqueue_seconds=4.0, lease=3.0, visibility_timeout=5.0,
                 provider_timeout=1.0, deadline=120.0, seed=SEED + 2)
    r = run_scenario(s, tmp_path / s.name)
    print(explain(r))
    assert r.ok, explain(r)
    assert r.duplicates == 0 and r.undelivered_not_review == 0, explain(r)
    assert r.kills >= 1 and r.faults >= 1, "the run must actually have been disturbed: " + explain(r)
