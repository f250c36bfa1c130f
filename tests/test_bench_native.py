"""``python -m bench.redis_path --native``: the native-command prototypes do what their figures claim.

Issue 34 measures a claim and a completion made of native commands beside the ledger. These tests hold the
prototypes to the moves they stand for, against the machine's Redis 7 and Valkey 9: a second claim of a key
is refused, a completion without the claim is refused, and the hybrid's ``sent`` records are layout 1's own
(the ledger reads them back), which is what makes its memory figure the ledger's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from bench.cleanup import delete_matching
from bench.redis_path import Prototype, _requests, _result, native
from idemmail_celery.ledger import State
from tests.conftest import REDIS_URL, unique, valkey_url

SERVERS = ["redis", pytest.param("valkey", marks=pytest.mark.valkey)]


@pytest.fixture(params=SERVERS)
def url(request: pytest.FixtureRequest) -> str:
    return REDIS_URL if request.param == "redis" else valkey_url()


@pytest.fixture
def proto(url: str) -> Iterator[Prototype]:
    p = Prototype(url, unique("proto"))
    yield p
    p.close()
    delete_matching(redis.Redis.from_url(url), f"{p.ns}*")


def test_the_native_records_claim_once_and_complete_under_the_claim(proto: Prototype, url: str) -> None:
    client = redis.Redis.from_url(url)
    requests, result = _requests(uuid.uuid4().hex, 3), _result()
    for r in requests:
        proto.native(r, result)
        stored = client.get(f"{proto.ns}:n:{r.key}")
        assert stored is not None and stored.startswith(b"s|1|")  # recorded sent, by SET IFEQ or the script
        with pytest.raises(RuntimeError, match="met a record"):  # SET NX GET sees the record
            proto.native(r, result)
    # Valkey 9 has SET ... IFEQ; Redis 7.0 has not, and the prototype says which it used.
    assert proto.ifeq is ("valkey_version" in client.info("server"))


def test_the_hybrid_sent_records_are_layout_1s_own(proto: Prototype) -> None:
    led = proto.shelf_ledger
    r, result = _requests(uuid.uuid4().hex, 1)[0], _result()
    proto.hybrid(r, result)
    record = led.get(r.key)
    assert record is not None and record.state is State.SENT and record.result == result
    assert record.fingerprint == r.fingerprint
    with pytest.raises(RuntimeError, match="met a record"):  # the shelf, read in the claim's MULTI
        proto.hybrid(r, result)


def test_a_completion_without_its_claim_is_refused(proto: Prototype, url: str) -> None:
    client = redis.Redis.from_url(url)
    k = f"{proto.ns}:x"
    client.set(k, "c|1|someone else's claim")
    assert not proto.shelve(keys=[k, f"{proto.ns}:shelf"], args=["c|1|mine", b"f", "entry", 1])
    assert not proto.cas(keys=[k], args=["c|1|mine", "s|1|sent", 1000])
    assert client.get(k) == b"c|1|someone else's claim"


def test_native_measures_every_variant(url: str) -> None:
    admin = redis.Redis.from_url(url, decode_responses=True)
    table = native(url, admin, 20, 1)
    assert set(table) == {"floor", "ledger", "native", "hybrid"}
    for row in table.values():
        assert row["cpu"][0] > 0 and row["wall"][0] > 0
    assert not list(admin.scan_iter("bench.native.*"))  # its keys are gone


@pytest.mark.valkey
def test_the_memory_section_reports_valkey_beside_redis() -> None:
    from bench import memory

    text = memory.section(300, "a test", "make bench")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| send_email")}
    assert set(rows) == {"send_email result", "send_email result, Valkey 9"}
    for line in rows.values():  # records, then bytes per record by INFO memory and by MEMORY USAGE
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == "300" and float(cells[2].replace(",", "")) > 0 and float(cells[3].replace(",", "")) > 0
    assert memory.SERVER == "redis"  # put back for the next measurement
