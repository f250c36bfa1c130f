"""A worker's memory after the largest messages ``send_email`` accepts: part ``rss`` of ``make bench`` (issue 35).

Big but legal messages (100,000 headers or tags, a 9 MB tag value, each under the 10 MiB cap) once left
prefork children at 400-750 MiB, kept after the message. The bounds on headers, tags and attachments
(:mod:`idemmail_celery.email`) and the refusal before the pool (:mod:`idemmail_celery._request`) leave a
message of about 10 MiB as the largest legal one. :func:`measure` sends ``messages`` of the largest kind,
one intent each, through a real ``-P prefork -c 2`` worker of ``bench.benchapp`` to the fake provider, a
few in flight at a time (the broker never holds them all), and compares the worker's resident memory
after the last with its memory idle, after start-up: per process (``VmRSS`` and ``Pss``, from ``/proc``)
and summed over the main process and its children. The figure to keep: the ``VmRSS`` sum after / idle
within 2 (:func:`section` says what each figure counts).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from chaos.procs import WorkerProcess, children_of, wait_until
from idemmail_celery.email import (
    MAX_ATTACHMENTS,
    MAX_FILENAME_CHARS,
    MAX_HEADER_VALUE_CHARS,
    MAX_HEADERS,
    MAX_SUBJECT_OCTETS,
    MAX_TAG_CHARS,
    MAX_TAGS,
    Attachment,
    EmailMessage,
)
from idemmail_celery.mail import TASK_NAME
from idemmail_celery.testing.fake_provider import FakeProvider

IN_FLIGHT = 2
SENDER = "Bench <bench@example.com>"  # bench.benchapp's idemmail_default_from: the worker counts it


def largest_message(budget: int, event_id: str) -> dict[str, Any]:
    """``send_email`` arguments at every bound at once, one attachment filling the size budget to the byte."""
    fields: dict[str, Any] = {
        "to": [f"r{i:02d}@example.com" for i in range(50)], "subject": "s" * MAX_SUBJECT_OCTETS, "text": "t",
        "headers": {f"X-{i:03d}".ljust(76, "h"): "v" * MAX_HEADER_VALUE_CHARS for i in range(MAX_HEADERS)},
        "tags": {f"{i:03d}".ljust(MAX_TAG_CHARS, "t"): "v" * MAX_TAG_CHARS for i in range(MAX_TAGS)},
    }
    names = [f"{i:03d}".ljust(MAX_FILENAME_CHARS, "n") for i in range(MAX_ATTACHMENTS)]

    def attached(last: bytes) -> list[Attachment]:
        return [Attachment(n, last if n is names[-1] else b"", "application/octet-stream") for n in names]

    def size(last: bytes) -> int:
        message = EmailMessage.build(sender=SENDER, **fields, attachments=attached(last), max_bytes=1 << 40)
        return message.size() + len(event_id)  # the budget counts the event_id stored beside it

    content = os.urandom((budget - size(b"")) // 4 * 3)  # base64: 4 bytes for every 3
    assert size(content) <= budget < size(content + b"123")
    return {**fields, "event_id": event_id, "attachments": [a.to_payload() for a in attached(content)]}


def process_memory(pid: int) -> tuple[int, int]:
    """``(VmRSS, Pss)`` of one process in bytes, from ``/proc`` (``smaps_rollup``); ``(0, 0)`` once it is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    except OSError:
        return 0, 0
    fields = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in rollup)}
    return fields.get("Rss", 0), fields.get("Pss", 0)


def worker_memory(pid: int) -> dict[str, Any]:
    """The worker's main process ``pid`` and its pool children: ``VmRSS`` and ``Pss`` of each, and their sums."""
    main = process_memory(pid)
    children = {c: process_memory(c) for c in sorted(children_of(pid))}
    every = [main, *children.values()]
    return {"main": main, "children": children, "rss": sum(m[0] for m in every), "pss": sum(m[1] for m in every)}


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its children: the sum of their ``VmRSS``."""
    return int(worker_memory(pid)["rss"])


def measure(h: Any, provider: FakeProvider, ledger_redis: str, messages: int, settle: float = 3.0) -> dict[str, Any]:
    """Send ``messages`` of :func:`largest_message` through a prefork worker; its memory idle and after."""
    mid = "rss"
    task = h.app.tasks[TASK_NAME]
    budget = int(task.idem_settings.max_message_bytes)
    provider.latency, provider.dedupe = 0.0, False
    provider.reset()
    h.queue[0] = f"{h.ns}.{mid}"
    env = h.worker_env(mid, ledger_redis, {"prefix": f"{h.ns}.{mid}.led"}, BENCH_PROVIDER_URL=provider.url)
    w = WorkerProcess(f"{h.ns}-{mid}", "bench.benchapp", ["-P", "prefork", "-c", "2", "-Q", h.queue[0]], env, h.tmp)
    largest = largest_message(budget, "rss-0000")
    t0 = time.monotonic()
    try:
        w.start()
        time.sleep(settle)
        assert w.proc is not None
        idle = worker_memory(w.proc.pid)
        peak = idle["rss"]
        for i in range(messages):
            wait_until(lambda i=i: provider.delivery_count() >= i - IN_FLIGHT, timeout=h.args.timeout, interval=0.02)
            task.delay(**{**largest, "event_id": f"rss-{i:04d}"})
            peak = max(peak, tree_rss(w.proc.pid))
        if not wait_until(lambda: provider.delivery_count() >= messages, timeout=h.args.timeout, interval=0.05):
            raise RuntimeError(f"rss: {provider.delivery_count()} of {messages} delivered; see {w.log_path}")
        time.sleep(settle)
        after = worker_memory(w.proc.pid)
    finally:
        w.stop()
    return {"messages": messages, "message_bytes": budget, "idle": idle["rss"], "after": after["rss"],
            "peak_seen": peak, "ratio": after["rss"] / idle["rss"], "pss_ratio": after["pss"] / idle["pss"],
            "idle_detail": idle, "after_detail": after,
            "deliveries": provider.delivery_count(), "seconds": time.monotonic() - t0}


def _rows(r: dict[str, Any]) -> str:
    """One row per process (the pool's children by pid, matched between idle and after), then the sums."""
    mib = 1024 * 1024
    idle, after = r["idle_detail"], r["after_detail"]

    def row(name: str, a: tuple[int, int], b: tuple[int, int]) -> str:
        ratio = f"{b[0] / a[0]:.2f}" if a[0] and b[0] else "-"
        return (f"| {name} | {a[0] / mib:.0f} MiB | {b[0] / mib:.0f} MiB | {ratio} | {a[1] / mib:.0f} MiB "
                f"| {b[1] / mib:.0f} MiB |")

    rows = [row("main process", idle["main"], after["main"])]
    for n, pid in enumerate(sorted(set(idle["children"]) | set(after["children"])), 1):
        rows.append(row(f"pool child {n}", idle["children"].get(pid, (0, 0)), after["children"].get(pid, (0, 0))))
    rows.append(f"| **worker (sum)** | **{idle['rss'] / mib:.0f} MiB** | **{after['rss'] / mib:.0f} MiB** | "
                f"**{r['ratio']:.2f}** | {idle['pss'] / mib:.0f} MiB | {after['pss'] / mib:.0f} MiB "
                f"({r['pss_ratio']:.2f}) |")
    return "\n".join(rows)


def section(r: dict[str, Any], command: str, facts: str) -> str:
    mib = 1024 * 1024
    return f"""## A worker's memory after the largest legal messages (`make bench`)

```
{command}
```

Run on {facts}. One `-P prefork -c 2` worker (`bench.benchapp`, Redis ledger) sends {r['messages']:,}
messages of the largest kind `send_email` accepts, one intent each, to the fake provider, at most
{IN_FLIGHT} in flight: every bound at once (50 recipients, a {MAX_SUBJECT_OCTETS}-octet subject, {MAX_HEADERS}
headers of {MAX_HEADER_VALUE_CHARS} characters, {MAX_TAGS} tags of {MAX_TAG_CHARS} + {MAX_TAG_CHARS},
{MAX_ATTACHMENTS} attachments named in {MAX_FILENAME_CHARS} characters), the attachments filling the size
budget to the byte ({r['message_bytes'] / mib:.0f} MiB). The worker's memory idle (3 s after its `ready.`
line, before any task: the pool children have not yet imported what a first send imports) and 3 s
after the last delivery, per process and summed. The figure kept within 2 is the sum of `VmRSS`
over the main process and its children, each counting the pages it shares with the others (what
it inherited at fork and never wrote); `Pss` counts each shared page once, split between its sharers
(its sum is what the worker takes from the machine), so what a process grows by, in pages of its own,
weighs more in that ratio.

| process | `VmRSS` idle | `VmRSS` after | after / idle | `Pss` idle | `Pss` after (after / idle) |
|---|---:|---:|---:|---:|---:|
{_rows(r)}

| highest `VmRSS` sum seen while sending | deliveries | seconds |
|---:|---:|---:|
| {r['peak_seen'] / mib:.0f} MiB | {r['deliveries']:,} | {r['seconds']:.0f} |
"""
