"""Issue 23: every chain keeps its claim, on real workers, with a ledger Redis the test stops and starts.

Each test ends with every intent sent exactly once and nothing left ``claimed``: an outage at the
release or at the claim, or a worker that cannot set the call up, hands the chain on with the owner
that holds its claim, and the next delivery takes it back.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from idemmail_celery.ledger import State, from_url
from idemmail_celery.testing.redis_server import RedisServer

from ..conftest import POSTGRES_URL, wait_for
from .conftest import Sink, refusing_worker


def test_a_retry_whose_release_and_next_claim_meet_a_ledger_outage_sends_once(
    app_module: Any, ns: str, sink: Sink, start_worker: Any, ledger_redis: RedisServer
) -> None:
    # Case 1: a transient provider error whose release meets the ledger stopped, and whose retry's claim
    # meets it too. Before: the retry found its own chain's claim busy until the in-flight budget ran out
    # ("still held by" its own task), with the record left claimed and nothing sent.
    worker = start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_LEDGER": ledger_redis.url})
    sink.control("hold", "1.5")  # the body runs this long holding its claim: the ledger stops meanwhile
    sink.push_failure("transient")
    ar = app_module.send.delay("ann@example.com", 71)
    wait_for(lambda: len(sink.pids()) >= 1, timeout=60)
    ledger_redis.stop()
    wait_for(lambda: worker.log().count(b"status=ledger_unavailable") >= 2, timeout=60)  # the retry waits
    sink.r.delete(sink.k("ctl.hold"))
    ledger_redis.start()
    assert ar.get(timeout=120)["status"] == "sent"
    assert len(sink.deliveries()) == 1
    ledger = from_url(ledger_redis.url, prefix=f"led.{ns}")
    record = ledger.get(app_module.send.intent_key("ann@example.com", 71))
    assert record is not None and record.state is State.SENT and record.reclaims == 0


def test_a_worker_without_the_ledgers_driver_keeps_the_message_and_says_what_to_install(
    app_module: Any, ns: str, sink: Sink, start_worker: Any, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # Case 4: a PostgreSQL ledger on a worker without psycopg. Before: the worker said ready, the task
    # ended FAILURE with ModuleNotFoundError, and the message was gone.
    blocker = tmp_path / "no-driver"
    (blocker / "psycopg").mkdir(parents=True)
    (blocker / "psycopg" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'psycopg\'", name="psycopg")\n')
    env = {"IDEMMAIL_TEST_LEDGER": POSTGRES_URL}
    broken = start_worker("-P", "prefork", "-c", "1",
                          env={**env, "PYTHONPATH": f"{blocker}:{worker_env['PYTHONPATH']}"})
    ar = app_module.send.delay("ann@example.com", 72)
    wait_for(lambda: broken.log().count(b"status=setup_error") >= 2, timeout=60)
    log = broken.log().decode(errors="replace")
    fixes = [line for line in log.splitlines() if "pip install 'idemmail-celery[postgres]'" in line]
    assert len(fixes) == 1 and "ERROR" in fixes[0]  # one line that says what to do
    assert re.search(r"WARNING.*status=setup_error", log)  # each delivery: its own outcome, at WARNING
    assert sink.deliveries() == [] and not ar.ready()
    broken.stop()
    start_worker("-P", "prefork", "-c", "1", env=env)  # the driver installed, the worker restarted
    try:
        assert ar.get(timeout=120)["status"] == "sent"
        assert len(sink.deliveries()) == 1
    finally:
        ledger = from_url(POSTGRES_URL, table=f"led_{ns}")
        ledger.drop_table()  # type: ignore[attr-defined]
        ledger.close()


def test_a_campaign_on_a_worker_without_the_api_key_waits_and_sends_everyone_once_when_fixed(
    app_module: Any, worker_env: dict[str, str], start_worker: Any
) -> None:
    # Case 3: an HTTP provider without its API key. Before: SUCCESS with "pending: 4" after 30 passes,
    # nothing held and nothing sent once the key was set. Now the campaign waits like send_email.
    from idemmail_celery.bulk import CAMPAIGN_TASK
    from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

    with FakeProvider() as fake:
        worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY="")
        broken = start_worker("-P", "prefork", "-c", "1")
        people = [f"r{i}@example.com" for i in range(4)]
        ar = app_module.app.tasks[CAMPAIGN_TASK].delay(campaign_id="no-key", recipients=people, subject="Hi",
                                                         text="t")
        wait_for(lambda: broken.log().count(f"send_campaign[{ar.id}] retry:".encode()) >= 35, timeout=120)
        assert not ar.ready() and fake.attempt_count() == 0  # past MAX_PASSES, still waiting
        broken.stop()
        start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_PROVIDER_KEY": DEFAULT_API_KEY})
        out = ar.get(timeout=120)
        assert out["sent"] + out["duplicate"] == 4 and out["pending"] == 0
        assert fake.delivery_count() == 4


def test_a_worker_checks_its_set_up_before_ready_and_can_refuse_to_start(
    worker_env: dict[str, str], start_worker: Any, tmp_path: Path
) -> None:
    # Case 6: before, a worker without the provider's API key started without a word. Now one ERROR line
    # with the fix comes before "ready."; with idemmail_refuse_to_start the worker exits instead.
    from idemmail_celery.testing.fake_provider import FakeProvider

    with FakeProvider() as fake:
        worker_env.update(IDEMMAIL_TEST_PROVIDER=fake.url, IDEMMAIL_TEST_PROVIDER_KEY="")
        log = start_worker("-P", "solo").log().decode(errors="replace")
        ready = log.index("ready.")
        errors = [m.start() for m in re.finditer(r"ERROR.*start-up check of idemmail_celery.send_email failed", log)]
        assert len(errors) == 1 and errors[0] < ready and "idemmail_provider_api_key" in log[errors[0]:ready]
        code, text = refusing_worker(worker_env, tmp_path / "refusing.log")
        assert code != 0 and "refusing to start" in text and "ready." not in text


def test_a_campaign_whose_key_secret_is_rotated_between_passes_sends_each_recipient_once(
    app_module: Any, ns: str, worker_env: dict[str, str], start_worker: Any, ledger_redis: RedisServer
) -> None:
    # Case 2: a pass sends over SMTP and cannot record (the ledger stops); the next passes run on workers
    # redeployed with ["new", "old"] secrets. Before: their keys matched none of the verdicts, the claims
    # were taken back under the old keys and sent again, and the campaign never ended.
    from idemmail_celery.bulk import CAMPAIGN_TASK
    from idemmail_celery.testing.smtp_sink import SMTPSink

    with SMTPSink(slow_seconds=1.0) as smtp:
        worker_env.update(IDEMMAIL_TEST_PROVIDER=smtp.url, IDEMMAIL_TEST_PROVIDER_TIMEOUT="5",
                          IDEMMAIL_TEST_LEDGER=ledger_redis.url)
        old = start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_KEY_SECRETS": "old"})
        # The first send's final reply comes a second late: the ledger stops while it waits, after its
        # write-ahead mark, so it is sent and cannot be recorded (the sends after it send nothing: their
        # marks cannot be written while the ledger is down).
        smtp.fail_next("slow_data")
        # One batch of 40: the ledger stops while most of them are still to be sent (no timing to win).
        people = [f"r{i}@example.com" for i in range(40)]
        ar = app_module.app.tasks[CAMPAIGN_TASK].delay(campaign_id="rotated", recipients=people, subject="Hi",
                                                         text="t", batch_size=40)
        wait_for(lambda: smtp.count() >= 1, timeout=60, interval=0.005)
        ledger_redis.stop()  # while the first send waits for its final reply
        wait_for(lambda: old.log().count(b"was sent but could not be recorded yet") >= 1, timeout=60)
        wait_for(lambda: b"send_campaign[" in old.log() and b"retry:" in old.log(), timeout=60)
        # SIGTERM to the whole process group (as systemd's default KillMode does): the pool child dies at once,
        # and if that is after its pass published the next one and before the message was acked, the broker
        # hands the first pass out again with none of its state (a stale copy, taking the expired claims over).
        old.stop()
        ledger_redis.start()
        start_worker("-P", "prefork", "-c", "1", env={"IDEMMAIL_TEST_KEY_SECRETS": "new,old"})
        out = ar.get(timeout=120)
        delivered = sorted(",".join(m.rcpt_tos) for m in smtp.messages())
        assert len(delivered) == 40 and len(set(delivered)) == 40, delivered  # each recipient once
        # Every record ends sent: a stale copy parks the claims it took over for review (it cannot know), and
        # the pass carrying their verdicts records them sent. Before: 37 of 40 left in review in 2 of 15 runs.
        ledger = from_url(ledger_redis.url, prefix=f"led.{ns}")
        try:
            wait_for(lambda: Counter(r.state for r in ledger.iter_records()) == Counter({State.SENT: 40}), timeout=60)
        finally:
            ledger.close()
        # The result counts everyone, none pending. Celery keeps the first copy's result: after a stale copy,
        # its "review" for the claims it parked (each field named: pytest cuts a dict in a message short).
        counts = {o: out[o] for o in ("sent", "duplicate", "failed", "review", "pending")}
        assert sum(counts.values()) == 40 and counts["failed"] == counts["pending"] == 0, counts
