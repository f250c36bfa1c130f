"""The Redis ledger on a real 3-node Redis Cluster and behind a real Sentinel, all on loopback.

The fixtures start ``redis-server`` processes on free ports in a temporary directory
(cluster mode, no persistence) and always stop them. A missing ``redis-server``/``redis-cli``
binary fails the tests (see ``service_missing`` in conftest.py).
"""

from __future__ import annotations

import inspect
import multiprocessing
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from idemmail_celery.errors import LedgerLostError, LedgerUnavailableError, UnknownLedgerSchemeError
from idemmail_celery.ledger import ClaimRequest, ClaimStatus, Ledger, State, backend_for, from_url
from idemmail_celery.ledger.redis import RedisLedger

from . import test_ledger_contract as contract
from .conftest import service_missing, unique, wait_for


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (+10000), so at most 55535."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    while True:
        port = random.randrange(20000, 55000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue


def req(key: str, lease: float = 30.0) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="t.send", payload='{"args":[],"kwargs":{}}', fingerprint="f" * 64,
                        lease_seconds=lease)


def pings(port: int) -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


class Cluster:
    """Three primaries, no replicas, no persistence: a node restarted comes back empty."""

    def __init__(self, workdir: Path) -> None:
        for binary in ("redis-server", "redis-cli"):
            if shutil.which(binary) is None:
                service_missing(binary, FileNotFoundError(binary))
        self.dir = workdir
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        while len(self.ports) < 3:
            port = free_port(cluster=True)
            if self.start_node(port, first=True):
                self.ports.append(port)
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait_ok()

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start_node(self, port: int, *, first: bool = False) -> bool:
        """Start the node on ``port``; False if it exited at once, its port (or its bus port) taken by another
        process between the choice and the bind (``first``: its first start, when another port will do)."""
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(self.dir / f"nodes-{port}.conf"), "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--daemonize", "no", "--maxmemory-policy", "noeviction"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.procs[port]
        wait_for(lambda: pings(port) or (first and proc.poll() is not None), timeout=20)
        if proc.poll() is not None:
            del self.procs[port]
            return False
        return True

    def restart_empty(self, port: int) -> None:
        """SIGKILL one node and start it again without its data (it keeps its slots)."""
        proc = self.procs[port]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.start_node(port)
        self.wait_ok()

    def wait_ok(self) -> None:
        def ok() -> bool:
            try:
                infos = [redis.Redis(host="127.0.0.1", port=p, decode_responses=True).cluster("info")
                         for p in self.ports]
                return all(info["cluster_state"] == "ok" for info in infos)
            except redis.RedisError:
                return False
        wait_for(ok, timeout=60, interval=0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


def wipe(led: RedisLedger, pattern: str | None = None) -> int:
    names = list(led.client.scan_iter(match=pattern or f"{led.prefix}:*", count=1000))
    pipe = led.client.pipeline(transaction=False)
    for name in names:
        pipe.delete(name)
    pipe.execute()
    return len(names)


@pytest.fixture
def ledger(redis_cluster: Cluster) -> Iterator[Ledger]:
    """The contract suite's ``ledger``, here on the cluster (overrides tests/conftest.py's)."""
    led = from_url(redis_cluster.url, prefix=unique("cl"))
    assert isinstance(led, RedisLedger)
    led.ping()
    yield led
    wipe(led)
    led.close()


# The ledger contract, run again on the cluster: every test that takes only ``ledger``.
_ELSEWHERE = {"test_concurrent_processes_exactly_one_wins"}  # reads a single server's URL; raced below
for _name, _fn in vars(contract).items():
    if _name.startswith("test_") and _name not in _ELSEWHERE and callable(_fn):
        _params = set(inspect.signature(_fn).parameters)
        if "ledger" in _params and not _params & {"request", "backend", "tmp_path_factory"}:
            globals()[f"{_name}_on_cluster"] = _fn


def test_cluster_url_scheme_is_registered() -> None:
    assert backend_for("redis+cluster://127.0.0.1:7000") is RedisLedger
    assert backend_for("sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380") is RedisLedger


def test_an_unknown_scheme_is_refused_naming_every_form_the_docs_use() -> None:
    with pytest.raises(UnknownLedgerSchemeError) as info:
        backend_for("mongodb://127.0.0.1/x")
    known = str(info.value).split("known: ", 1)[1].rstrip(")").split(", ")
    for form in ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://", "sentinel://", "sqlite://",
                 "postgresql://", "mysql://"):
        assert form in known
    for form in known:  # every form named is served
        assert backend_for(form + "h/x")


def test_buckets_spread_over_every_node_and_listing_sees_them_all(ledger: Ledger) -> None:
    assert isinstance(ledger, RedisLedger)
    keys = [f"spread{i}" for i in range(200)]
    assert all(c.status is ClaimStatus.ACQUIRED for c in ledger.claim_many([req(k) for k in keys]))
    for k in keys[:50]:
        c = ledger.claim(req(k))
        assert c.status is ClaimStatus.BUSY
    nodes = {ledger.client.get_node_from_key(ledger.names.record(k)).name for k in keys}
    assert len(nodes) == 3, nodes
    listed = {r.key for r in ledger.iter_records(State.CLAIMED)}
    assert listed == set(keys)
    assert ledger.stats()["claimed"] == 200


def test_first_send_two_round_trips_duplicate_one(ledger: Ledger) -> None:
    assert isinstance(ledger, RedisLedger)
    warm = ledger.claim(req("warm"))  # the store check and each script's load happen once per process
    ledger.complete("warm", warm.token, {"message_id": "m"})  # (a cluster loads a script on every node)
    calls: list[str] = []
    send = ledger.client.execute_command

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[0]))
        return send(*args, **kwargs)

    ledger.client.execute_command = counting
    c = ledger.claim(req("rt"))
    ledger.complete("rt", c.token, {"message_id": "m"})
    first = len(calls)
    dup = ledger.claim(req("rt"))
    assert dup.status is ClaimStatus.DONE
    assert (first, len(calls) - first) == (2, 1), calls


def _claim_through(url: str, prefix: str, keys: list[str], ready: Any, starts: list[Any], out: Any) -> None:
    led = from_url(url, prefix=prefix)
    led.ping()
    ready.put(None)
    for key, start in zip(keys, starts, strict=True):  # one race per key, each on the parent's signal
        start.wait()
        out.put(led.claim(req(key)).status.value)


def test_claim_race_across_clients_of_different_nodes(redis_cluster: Cluster) -> None:
    prefix = unique("race")
    ctx = multiprocessing.get_context("forkserver")  # as test_ledger_contract's race: imported once, forked
    ctx.set_forkserver_preload(["idemmail_celery.ledger", __name__])
    probe = from_url(redis_cluster.url, prefix=prefix)
    probe.ping()  # the ledger's markers exist before the race
    try:
        keys = [f"race{round_}" for round_ in range(3)]
        ready, starts, out = ctx.Queue(), [ctx.Event() for _ in keys], ctx.Queue()
        # Each process has its own RedisCluster client, entering through a different node; three races.
        urls = [f"redis+cluster://127.0.0.1:{redis_cluster.ports[i % 3]}" for i in range(6)]
        procs = [ctx.Process(target=_claim_through, args=(u, prefix, keys, ready, starts, out)) for u in urls]
        for p in procs:
            p.start()
        for _ in procs:  # every process has imported, connected and checked the store
            ready.get(timeout=60)
        for start in starts:
            start.set()
            statuses = [out.get(timeout=60) for _ in procs]
            assert sorted(statuses) == ["acquired"] + ["busy"] * 5, statuses
        for p in procs:
            p.join(timeout=30)
    finally:
        assert isinstance(probe, RedisLedger)
        wipe(probe)


def test_losing_one_buckets_keys_on_one_node_is_detected(ledger: Ledger, redis_cluster: Cluster) -> None:
    assert isinstance(ledger, RedisLedger)
    keys = [f"lose{i}" for i in range(64)]
    ledger.claim_many([req(k) for k in keys])
    victim = ledger.names.bucket(keys[0])
    assert wipe(ledger, f"{ledger.prefix}:{{{victim:02x}}}:*") >= 3
    fresh = from_url(redis_cluster.url, prefix=ledger.prefix)
    with pytest.raises(LedgerLostError, match=f"buckets {victim} lost"):
        fresh.claim(req("new-one"))
    with pytest.raises(LedgerLostError):
        ledger.claim(req(keys[0]))
    assert ledger.get(keys[0]) is None


@pytest.mark.worker
def test_a_shard_restarted_empty_stops_every_worker_until_acknowledged(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)  # a cluster of its own: one node is killed
    try:
        led = from_url(cluster.url, prefix=unique("shard"))
        assert isinstance(led, RedisLedger)
        keys = [f"s{i}" for i in range(64)]
        for c, k in zip(led.claim_many([req(k) for k in keys]), keys, strict=True):
            led.complete(k, c.token, {"message_id": k})
        on_node = {k: led.client.get_node_from_key(led.names.record(k)).port for k in keys}
        victim = cluster.ports[1]
        lost_key = next(k for k in keys if on_node[k] == victim)
        kept_key = next(k for k in keys if on_node[k] != victim)
        cluster.restart_empty(victim)

        with pytest.raises(LedgerLostError):  # the record is gone; without the marker this would send again
            led.claim(req(lost_key))
        with pytest.raises(LedgerLostError):  # every bucket is flagged now, on every node
            led.claim(req(kept_key))
        fresh = from_url(cluster.url, prefix=led.prefix)
        assert isinstance(fresh, RedisLedger)
        assert fresh.loss_status()["state"] == "lost"
        led.acknowledge_loss(note="node restarted without AOF", actor="test")
        assert fresh.claim(req(kept_key)).status is ClaimStatus.DONE  # what survived still protects
        assert fresh.claim(req(lost_key)).status is ClaimStatus.ACQUIRED  # what was lost is forgotten
        led.close()
        fresh.close()
    finally:
        cluster.stop()


def _batch_across(led: RedisLedger, victim: int, n_other: int = 4) -> tuple[list[str], list[str]]:
    """Fresh keys of this test: one on the ``victim`` node's port, ``n_other`` on the other nodes."""
    cands = [f"nb{i}" for i in range(200)]
    on = {k: led.client.get_node_from_key(led.names.record(k)).port for k in cands}
    return [k for k in cands if on[k] == victim][:1], [k for k in cands if on[k] != victim][:n_other]


def test_a_batch_a_node_refuses_hands_back_what_the_other_nodes_took(ledger: Ledger, redis_cluster: Cluster) -> None:
    assert isinstance(ledger, RedisLedger)
    victim = redis_cluster.ports[2]
    on_victim, others = _batch_across(ledger, victim)
    fresh, released, expired, sent = others
    c = ledger.claim(req(released))
    ledger.release(released, c.token)
    ledger.claim(req(expired, lease=0.05))
    c = ledger.claim(req(sent))
    ledger.complete(sent, c.token, {"message_id": "m"})
    time.sleep(0.1)
    node = redis.Redis(host="127.0.0.1", port=victim)
    node.config_set("maxmemory", 1)  # the node refuses every write (OOM) while the others run the batch
    try:
        with pytest.raises(LedgerUnavailableError, match="maxmemory"):  # fail closed: the message comes back
            ledger.claim_many([req(k) for k in [*on_victim, fresh, released, expired, sent]])
    finally:
        node.config_set("maxmemory", 0)
    assert ledger.get(on_victim[0]) is None
    for k in (fresh, released):  # nothing was sent under them: handed back
        record = ledger.get(k)
        assert record is not None and record.state is State.RELEASED, (k, record)
        assert record.error is not None and record.error["reason"] == "batch_met_failed_node"
    record = ledger.get(expired)  # reclaimed: left claimed with its lease ended, for the reclaim rules
    assert record is not None and record.state is State.CLAIMED and record.reclaims == 1, record
    assert (record.lease_expires_at or 0) <= time.time()
    assert ledger.claim(req(expired)).status is ClaimStatus.RECLAIMED
    assert (r := ledger.get(sent)) is not None and r.state is State.SENT


@pytest.mark.worker
def test_a_node_stopped_mid_batch_leaves_no_claim_held_on_the_others(tmp_path: Path) -> None:
    # A cluster of its own: one node is frozen (SIGSTOP) after the batch is written to it, so its
    # reply never comes while the other nodes ran their claims. About 3 s (cluster start, 0.5 s timeout).
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from idemmail_celery.errors import LedgerUnavailableError

    cluster = Cluster(tmp_path)
    victim = cluster.ports[1]
    try:
        led = from_url(cluster.url, prefix=unique("stop"), socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        assert isinstance(led, RedisLedger)
        led.claim_many([req(f"warm{i}") for i in range(32)])  # a connection to every node
        on_victim, others = _batch_across(led, victim)
        cluster.procs[victim].send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(LedgerUnavailableError):
                led.claim_many([req(k) for k in [*on_victim, *others]])
        finally:
            cluster.procs[victim].send_signal(signal.SIGCONT)
        for k in others:
            record = led.get(k)
            assert record is not None and record.state is State.RELEASED, (k, record)
        # The frozen node ran its claim when it woke: nobody can know, so it is left to its lease.
        record = led.get(on_victim[0])
        assert record is None or record.state is State.CLAIMED
        led.close()
    finally:
        cluster.stop()


# -- Sentinel --


class SentinelSetup:
    """A private redis-server and one Sentinel monitoring it as ``mymaster``."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            service_missing("redis-server", FileNotFoundError("redis-server"))
        self.redis_port, self.sentinel_port = free_port(), free_port()
        self.procs = [subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)]
        wait_for(lambda: pings(self.redis_port), timeout=20)
        conf = workdir / "sentinel.conf"
        conf.write_text(f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {workdir}\n"
                        f"sentinel monitor mymaster 127.0.0.1 {self.redis_port} 1\n")
        self.procs.append(subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL))
        wait_for(self.knows_master, timeout=30)

    def knows_master(self) -> bool:
        try:
            addr: Any = redis.Redis(host="127.0.0.1", port=self.sentinel_port).sentinel_get_master_addr_by_name(
                "mymaster")
            return bool(addr) and int(addr[1]) == self.redis_port
        except redis.RedisError:
            return False

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=10)


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[SentinelSetup]:
    setup = SentinelSetup(tmp_path)
    try:
        yield setup
    finally:
        setup.stop()


def test_claim_complete_duplicate_through_sentinel(sentinel: SentinelSetup) -> None:
    url = f"sentinel://127.0.0.1:{sentinel.sentinel_port};sentinel://127.0.0.1:{free_port()}"  # one is down
    led = from_url(url, master_name="mymaster", prefix=unique("sen"))
    c = led.claim(req("k"))
    assert c.status is ClaimStatus.ACQUIRED
    led.complete("k", c.token, {"message_id": "m"})
    dup = led.claim(req("k"))
    assert dup.status is ClaimStatus.DONE and dup.record.result == {"message_id": "m"}
    # The record is on the server Sentinel named, not somewhere else.
    direct = redis.Redis(host="127.0.0.1", port=sentinel.redis_port, decode_responses=True)
    assert direct.exists(led.names.shelf("k"))  # type: ignore[attr-defined]  # its sent record's shelf
    led.close()


def test_sentinel_url_needs_master_name() -> None:
    from idemmail_celery.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="master_name"):
        from_url("sentinel://127.0.0.1:26379")
