"""The Django admin's review queue with 10,000 parked records: how long each page takes to render.

::

    python -m bench.admin_pages                                  # Redis and PostgreSQL, 10,000 records each
    python -m bench.admin_pages --records 2000 --backends redis  # a quick look
    python -m bench.admin_pages --screenshots docs/img            # and the PNGs docs/django.md shows

Runs ``examples/django_shop`` in this process (Django's test client; users and sessions in a SQLite file of
its own), points the project's ledger at a new Redis prefix and a new PostgreSQL table in turn, parks
``--records`` ``send_email`` intents there as workers park them (claim, then park with a reason: 60%
``lease_expired``, 30% ``after_data``, 10% ``ledger_lost``; one in ten of another task; their times spread
over the last 30 days), and renders each page of the list below ``--repeat`` times, logged in as a
superuser. A page's time is the whole request: the view, the ledger's calls and the template.

Two figures per page: **cold**, the first render of its filters (the sidebar's counts computed in the
store: on Redis a pass over the state's records), and **warm**, the median of the renders after it (the
counts kept :data:`~idemmail_celery.contrib.django.review.SUMMARY_SECONDS`, as they are while an operator
pages through). The records are deleted afterwards. Prints a Markdown table; writes nothing else unless
``--screenshots`` (headless Chromium at /usr/bin/chromium, on the Redis ledger).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = os.environ.get("IDEMMAIL_TEST_REDIS", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("IDEMMAIL_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
LIST = "/admin/idemmail/reviewrecord/"
OTHER_TASK = "idemmail_celery.send_campaign"
DAYS = 30


def setup_django(tmp: Path) -> Any:
    """examples/django_shop configured in this process, its tables migrated into a SQLite file; the Celery app."""
    os.environ.update({"DJANGO_SETTINGS_MODULE": "examples.django_shop.settings",
                       "SHOP_DATABASE_URL": f"sqlite:///{tmp / 'admin.sqlite3'}", "SHOP_KEY_SECRET": "bench-secret",
                       "SHOP_PROVIDER_URL": "console://"})
    sys.path.insert(0, str(ROOT))
    import django
    from django.conf import settings
    from django.core.management import call_command

    settings.DATABASES  # noqa: B018  (loads the settings module)
    settings.ALLOWED_HOSTS = ["*"]
    django.setup()
    call_command("migrate", verbosity=0)
    from examples.django_shop import celery_app

    return celery_app


@contextmanager
def ledger_for(app: Any, backend: str) -> Iterator[Any]:
    """A new, empty ledger the admin reads (the project's setting pointed at it), deleted afterwards."""
    from idemmail_celery.contrib.django import admin as review_admin
    from idemmail_celery.ledger import from_url

    name = f"bench_admin_{uuid.uuid4().hex[:8]}"
    url, options = (REDIS_URL, {"prefix": name}) if backend == "redis" else (POSTGRES_URL, {"table": name})
    ledger = from_url(url, **options)
    app.conf.idemmail_ledger_url, app.conf.idemmail_ledger_options = url, options
    review_admin._operators.clear()
    review_admin.summaries.forget()
    try:
        yield ledger
    finally:
        if backend == "redis":
            client = ledger.client
            names = list(client.scan_iter(f"{name}:*", count=1000))
            for i in range(0, len(names), 1000):
                client.delete(*names[i:i + 1000])
        else:
            ledger.drop_table()
        ledger.close()
        review_admin._operators.clear()


def park(app: Any, ledger: Any, n: int) -> list[str]:
    """``n`` send_email intents parked as workers park them, their times spread over the last :data:`DAYS` days
    (the oldest first); returns their keys in that order."""
    from idemmail_celery.ledger import ClaimRequest

    send = app.tasks["idemmail_celery.send_email"]
    made = []
    for i in range(n):
        kwargs = {"to": f"customer{i}@example{i % 7}.com", "subject": f"Your receipt for order {i}",
                  "html": "<p>Thanks for your order.</p>" * 4, "event_id": f"order-{i}",
                  "template": ("receipt", "shipped", "welcome")[i % 3],
                  "tags": {"campaign": ("winter", "spring")[i % 2]}}
        made.append((send.intent_key(**kwargs), send.key_builder.payload((), kwargs).to_json()))
    reasons = ["lease_expired"] * 6 + ["after_data"] * 3 + ["ledger_lost"]
    for start in range(0, n, 500):
        batch = made[start:start + 500]
        claims = ledger.claim_many([ClaimRequest(key=k, task_name=OTHER_TASK if (start + j) % 10 == 9 else send.name,
                                                 fingerprint="f", payload=p) for j, (k, p) in enumerate(batch)])
        for j, ((key, _), claim) in enumerate(zip(batch, claims, strict=True)):
            ledger.park(key, claim.token, {"type": "SendNeedsReview", "reason": reasons[(start + j) % 10],
                                           "at": time.time(), "message": "outcome unknown: the worker was lost "
                                           "after the provider call began"})
    now = time.time()
    for i, (key, _) in enumerate(made):  # as if parked over the last 30 days, in this order
        record = ledger.get(key)
        at = now - DAYS * 86400 * (n - i) / n
        ledger._force(key, record.token, replace(record, token=record.token + 1, updated_at=at))
    return [k for k, _ in made]


def park_one(app: Any, ledger: Any) -> str:
    """One send parked as the SMTP provider parks a connection lost after the message was written."""
    from idemmail_celery.ledger import ClaimRequest

    send = app.tasks["idemmail_celery.send_email"]
    kwargs = {"to": ["ann@example.org", "Bob <bob@shop.example>"], "subject": "Your invoice 2026-0042",
              "text": "Attached.", "event_id": "invoice-2026-0042", "template": "invoice", "tags": {"batch": "nightly"}}
    key = send.intent_key(**kwargs)
    claim = ledger.claim(ClaimRequest(key=key, task_name=send.name, fingerprint="f",
                                      payload=send.key_builder.payload((), kwargs).to_json()))
    ledger.park(key, claim.token, {"type": "SendNeedsReview", "reason": "after_data", "at": time.time(),
                                   "maybe_sent": True, "message": "outcome unknown (after_data): SMTP connection "
                                   "lost after the message was written (SMTPServerDisconnected)"})
    return str(key)


def pages(keys: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """The pages measured: (what, query parameters); ``cursor`` is filled in with page 1's next link."""
    day = time.gmtime(time.time() - 3 * 86400)
    return [
        ("review, page 1 (oldest first)", {}),
        ("page 2 by its number (?p=2)", {"p": 2}),
        ("page 2 by the next link (cursor)", {"cursor": True}),
        ("page 50 (?p=50)", {"p": 50}),
        ("last page (?p=100)", {"p": 100}),
        ("newest first (?o=-updated)", {"o": "-updated"}),
        ("reason after_data", {"reason": "after_data"}),
        ("reason after_data, page 20", {"reason": "after_data", "p": 20}),
        ("reason ledger_lost, task send_campaign", {"reason": "ledger_lost", "task": OTHER_TASK}),
        ("age: last 24 hours", {"age": "24h"}),
        ("one day (date hierarchy)", {"updated__year": day.tm_year, "updated__month": day.tm_mon,
                                      "updated__day": day.tm_mday}),
        ("search an event id (1 match)", {"q": "order-4821"}),
        ("search a key's start (1 match)", {"q": keys[len(keys) // 2][:10]}),
        ("search a tag (half match)", {"q": "winter"}),
        ("search a domain and template", {"q": "example3.com shipped"}),
        ("search, no match", {"q": "no-such-order"}),
        ("a record's page", {"record": keys[7]}),
    ]


def measure(client: Any, repeat: int, keys: list[str]) -> list[tuple[str, float, float, float]]:
    """Each page: (what, cold ms, warm median ms, warm median ms of this process's CPU)."""
    import re

    from idemmail_celery.contrib.django import admin as review_admin

    review_admin.summaries.forget()
    first = client.get(LIST).content.decode()
    found = re.search(r'href="([^"]+)" id="next-page"', first)
    next_link = found.group(1).replace("&amp;", "&") if found else "?"
    out = []
    for what, params in pages(keys):
        if "record" in params:
            url, data = LIST + "record/", {"key": params["record"]}
        elif "cursor" in params:
            url, data = LIST + next_link, {}
        else:
            url, data = LIST, params
        review_admin.summaries.forget()
        times, cpu = [], []
        for _ in range(repeat + 1):
            start, used = time.perf_counter(), time.process_time()
            reply = client.get(url, data)
            times.append((time.perf_counter() - start) * 1000)
            cpu.append((time.process_time() - used) * 1000)
            assert reply.status_code == 200, (what, reply.status_code)
        out.append((what, times[0], statistics.median(times[1:]), statistics.median(cpu[1:])))
    return out


def screenshots(where: Path, superuser: tuple[str, str], app: Any, ledger: Any) -> list[Path]:
    """The list, a filtered list with rows ticked for a bulk action, and a record's page (one parked now, as an
    SMTP send is parked), in headless Chromium."""
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.test.testcases import LiveServerThread
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    where.mkdir(parents=True, exist_ok=True)
    server = LiveServerThread("127.0.0.1", StaticFilesHandler)
    server.daemon = True
    server.start()
    server.is_ready.wait()
    options = webdriver.ChromeOptions()
    profile = tempfile.mkdtemp(prefix="chromium-")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--disable-sync", f"--user-data-dir={profile}", "--window-size=1600,1000", "--hide-scrollbars"):
        options.add_argument(flag)
    options.binary_location = "/usr/bin/chromium"
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService("/usr/bin/chromedriver"))
    browser.implicitly_wait(30)
    base = f"http://127.0.0.1:{server.port}"
    shots = []
    try:
        browser.get(f"{base}/admin/login/?next={LIST}")
        browser.find_element(By.NAME, "username").send_keys(superuser[0])
        browser.find_element(By.NAME, "password").send_keys(superuser[1])
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        browser.find_element(By.ID, "result_list")
        browser.find_element(By.ID, "toggle-nav-sidebar").click()  # the page's width for the list
        shots.append(where / "admin-review-queue.png")
        browser.save_screenshot(str(shots[-1]))
        browser.get(f"{base}{LIST}?reason=after_data&q=shipped&o=-updated")
        for box in browser.find_elements(By.CSS_SELECTOR, "input.action-select")[:3]:
            box.click()
        Select(browser.find_element(By.NAME, "action")).select_by_value("failed")
        browser.find_element(By.ID, "bulk-note").send_keys("incident 42: orders cancelled, do not send")
        shots.append(where / "admin-review-bulk.png")
        browser.save_screenshot(str(shots[-1]))
        browser.get(f"{base}{LIST}record/?key={park_one(app, ledger)}")
        browser.find_element(By.ID, "record-error")
        shots.append(where / "admin-review-record.png")
        browser.save_screenshot(str(shots[-1]))
    finally:
        browser.quit()
        server.terminate()
        server.join(timeout=15)
    return shots


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--backends", default="redis,postgresql")
    parser.add_argument("--repeat", type=int, default=5, help="warm renders per page (their median is shown)")
    parser.add_argument("--screenshots", type=Path, default=None, help="a directory for the PNGs (Redis run)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        app = setup_django(Path(tmp))
        from django.contrib.auth.models import User
        from django.test import Client

        User.objects.create_superuser("bench", password="bench-password")
        client = Client()
        client.force_login(User.objects.get(username="bench"))
        results: dict[str, list[tuple[str, float, float, float]]] = {}
        for backend in args.backends.split(","):
            with ledger_for(app, backend) as ledger:
                started = time.perf_counter()
                keys = park(app, ledger, args.records)
                print(f"{backend}: {args.records:,} records parked in {time.perf_counter() - started:.0f} s",
                      file=sys.stderr)
                results[backend] = measure(client, args.repeat, keys)
                if args.screenshots and backend == "redis":
                    for shot in screenshots(args.screenshots, ("bench", "bench-password"), app, ledger):
                        print(f"screenshot: {shot}", file=sys.stderr)
        report(results, args.records)


def report(results: dict[str, list[tuple[str, float, float, float]]], records: int) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{records:,} parked records; Python {platform.python_version()}, {os.cpu_count()} cores, load average "
          f"at the end {load}. ms per request: cold (the filters' first render), warm (median after), and the "
          "web process's CPU of a warm one")
    backends = list(results)
    print("| page | " + " | ".join(f"{b} cold | {b} warm | {b} CPU" for b in backends) + " |")
    print("|---|" + "---:|---:|---:|" * len(backends))
    for i, (what, *_) in enumerate(results[backends[0]]):
        cells = [f"{cold:.0f} | {warm:.0f} | {cpu:.0f}" for _, cold, warm, cpu in (results[b][i] for b in backends)]
        print(f"| {what} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
