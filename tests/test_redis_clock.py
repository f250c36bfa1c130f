"""A Redis server whose clock steps (a failover to a lagging replica, an NTP step, a restored VM) never
makes a ``sent`` record invisible: every one still answers ``done``.

The server is a private ``redis-server`` (its own port on loopback, started and stopped here) run under
an ``LD_PRELOAD`` shim, compiled with gcc at test time, that shifts ``clock_gettime(CLOCK_REALTIME)``,
``gettimeofday`` and ``time`` by the microseconds written in a file: the test moves the server's clock
by rewriting it, and checks that it moved (``TIME``) before it looks. A layout that filed ``sent`` records
into archives named by the server's clock (a granule of retention / 8: 15 minutes here) would fail it from
the first step back past a granule.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from idemmail_celery.ledger import ClaimRequest, ClaimStatus, State
from idemmail_celery.ledger.redis import RedisLedger

from .conftest import service_missing, unique, wait_for
from .test_redis_scaleout import free_port, pings

pytestmark = pytest.mark.worker  # runs a process of its own (a redis-server under a clock shim)

SHIM = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

/* The shift in microseconds, read from the file named by CLOCK_SHIFT_FILE at every call. */
static long long shift_us(void) {
    const char *path = getenv("CLOCK_SHIFT_FILE");
    char buf[32] = {0};
    if (!path) return 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    return n > 0 ? strtoll(buf, NULL, 10) : 0;
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    int rc = (int)syscall(SYS_clock_gettime, clk, ts);
    if (rc == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
        long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + shift_us() * 1000LL;
        ts->tv_sec = (time_t)(ns / 1000000000LL);
        ts->tv_nsec = (long)(ns % 1000000000LL);
    }
    return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    int rc = clock_gettime(CLOCK_REALTIME, &ts);
    if (rc == 0 && tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return rc;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}
"""

HOUR = 3600.0
RETENTION = 2 * HOUR  # a clock-named archive's granule would be retention / 8 = 15 minutes


class ShiftedRedis:
    """A private redis-server whose wall clock this test sets (see the module docstring)."""

    def __init__(self, workdir: Path) -> None:
        for tool in ("gcc", "redis-server"):
            if shutil.which(tool) is None:
                service_missing(tool, FileNotFoundError(tool))
        (workdir / "shim.c").write_text(SHIM)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(workdir / "shim.so"), str(workdir / "shim.c")],
                       check=True, capture_output=True, timeout=120)
        self.shift_file = workdir / "shift"
        self.shift(0)
        self.port = free_port()
        env = {**os.environ, "LD_PRELOAD": str(workdir / "shim.so"), "CLOCK_SHIFT_FILE": str(self.shift_file)}
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL, env=env)
        wait_for(lambda: pings(self.port), timeout=20)
        self.client = redis.Redis(host="127.0.0.1", port=self.port)

    def shift(self, seconds: float) -> None:
        tmp = self.shift_file.with_suffix(".tmp")
        tmp.write_text(str(int(seconds * 1_000_000)))
        tmp.replace(self.shift_file)  # whole or not at all: the server reads it at every clock call

    def offset(self) -> float:
        """The server's clock (``TIME``) minus this process's, in seconds."""
        sec, usec = self.client.time()
        return sec + usec / 1_000_000 - time.time()

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ShiftedRedis]:
    shifted = ShiftedRedis(tmp_path)
    yield shifted
    shifted.stop()


def req(key: str) -> ClaimRequest:
    return ClaimRequest(key=key, task_name="idemmail_celery.send_email", payload='{"args":[],"kwargs":{}}',
                        fingerprint="ab" * 32)


def test_every_sent_record_answers_done_whatever_way_the_servers_clock_steps(server: ShiftedRedis) -> None:
    assert abs(server.offset()) < 60  # no shift: the server's clock is this machine's
    led = RedisLedger(f"redis://127.0.0.1:{server.port}/0", prefix=unique("clock"), retention_seconds=RETENTION)
    keys = [os.urandom(32).hex() for _ in range(50)] + ["plain-key"]
    for key in keys:
        claim = led.claim(req(key))
        assert claim.status is ClaimStatus.ACQUIRED
        led.complete(key, claim.token, {"message_id": f"m-{key}"})
    # Back by more than such a granule (15 min), back by an hour, forward within the retention.
    for shift in (-(RETENTION / 8 + 60), -HOUR, HOUR, RETENTION - 10 * 60):
        server.shift(shift)
        assert abs(server.offset() - shift) < 60, "the shim did not move the server's clock"
        for key in keys:
            dup = led.claim(req(key))
            assert dup.status is ClaimStatus.DONE, (shift, key, dup.status)
            assert dup.record.state is State.SENT and dup.record.result == {"message_id": f"m-{key}"}
            record = led.get(key)
            assert record is not None and record.state is State.SENT, (shift, key)
        batch = led.claim_many([req(key) for key in keys[:10]])
        assert {c.status for c in batch} == {ClaimStatus.DONE}, shift
        fresh = os.urandom(32).hex()  # and the ledger still takes new intents at that time
        claim = led.claim(req(fresh))
        assert claim.status is ClaimStatus.ACQUIRED
        led.complete(fresh, claim.token, {"message_id": "m"})
        assert led.claim(req(fresh)).status is ClaimStatus.DONE
    led.close()
