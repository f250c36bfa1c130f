"""examples/django_shop, the Django app of ``idemmail_celery.contrib.django``, run for real: Django set up in this
process (the test client, the admin, a live server for headless Chromium), its migrations applied on PostgreSQL (a
schema of its own, the project's ``default`` database), on SQLite (alias ``sqlite``) and on MariaDB (alias
``mariadb``, a database of its own, PyMySQL standing in for mysqlclient); one Celery worker of the project
(``celery -A examples.django_shop worker``) on the Redis broker and ledger for the whole module, and a fake provider
that does **not** de-duplicate, so every delivery it counts is one the library let through.

Django is set up once per process: this module configures it on first use and leaves it configured (nothing
else in the suite imports Django).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import current_app
from celery.result import AsyncResult
from celery.signals import before_task_publish

from examples._stack import celery_worker
from idemmail_celery.ledger import ClaimRequest, Ledger, State, from_url
from idemmail_celery.ledger.listing import label_of
from idemmail_celery.outbox import relay, run_relay
from idemmail_celery.testing.fake_provider import DEFAULT_API_KEY, FakeProvider

from ..conftest import MARIADB_URL, POSTGRES_URL, REDIS_URL, require_module, service_missing, unique, wait_for
from .conftest import ddl, drop_schema, results, web_services

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
ALIASES = ["default", "sqlite", "mariadb"]  # PostgreSQL (the project's own), SQLite, MariaDB


@dataclass
class Shop:
    app: Any  # the project's Celery app
    fake: FakeProvider
    ledger: Ledger
    env: dict[str, str]
    published: dict[str, str] = field(default_factory=dict)  # task id -> task name, in publish order

    def key(self, **email: Any) -> str:
        return str(self.app.tasks["idemmail_celery.send_email"].intent_key(**email))

    def order(self, alias: str, email: str, *, out_of_stock: bool = False) -> int | None:
        """An order with its confirmation email: through the view (``default``), or as the view does it on
        another database (``sqlite``, ``mariadb``). Returns the order id, None when the transaction rolled back."""
        from django.db import transaction
        from django.test import Client

        from examples.django_shop.models import Order
        from examples.django_shop.views import OutOfStock
        from idemmail_celery.contrib.django.outbox import enqueue_email

        if alias == "default":
            data = {"email": email, "total_cents": "4200", **({"out_of_stock": "1"} if out_of_stock else {})}
            reply = Client().post("/orders", data)
            assert reply.status_code == (409 if out_of_stock else 201), reply.content
            return None if out_of_stock else int(reply.json()["order_id"])
        try:
            with transaction.atomic(using=alias):
                order = Order.objects.using(alias).create(email=email, total_cents=4200)
                enqueue_email(using=alias, to=order.email, subject=f"Order {order.pk} confirmed",
                              html=f"<p>Thanks for order {order.pk}.</p>", event_id=f"order-{order.pk}",
                              template="order_confirmation")
                if out_of_stock:
                    raise OutOfStock
        except OutOfStock:
            return None
        return int(order.pk)

    def relay_url(self, alias: str) -> str:
        from idemmail_celery.contrib.django.conf import sqlalchemy_url

        return sqlalchemy_url(alias)

    def sent(self, key: str) -> bool:
        record = self.ledger.get(key)
        return record is not None and record.state is State.SENT


def _setup_django(env: dict[str, str], sqlite_path: Path, mariadb: sa.URL) -> None:
    import django
    import pymysql
    from django.conf import settings

    if settings.configured:
        pytest.fail("Django was already configured in this process: this module sets it up for its project")
    with pytest.MonkeyPatch.context() as mp:  # the settings module reads its environment once, here
        for name, value in env.items():
            mp.setenv(name, value)
        settings.DATABASES  # noqa: B018  (loads the settings module)
    # Restored: CELERY_BROKER_URL in the environment would be every later test's broker (Celery reads it).
    settings.DATABASES["sqlite"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(sqlite_path)}
    # Django's MySQL backend wants mysqlclient (a C build); PyMySQL, which the suite has, stands in for it.
    pymysql.version_info = (2, 2, 1, "final", 0)
    pymysql.install_as_MySQLdb()
    settings.DATABASES["mariadb"] = {"ENGINE": "django.db.backends.mysql", "NAME": mariadb.database,
                                     "USER": mariadb.username, "HOST": mariadb.host, "PORT": mariadb.port}
    settings.DATABASE_ROUTERS = [ShopTablesOnly()]
    django.setup()


class ShopTablesOnly:
    """The second and third databases get the outbox and the orders only (MariaDB's DDL is slow: each statement
    commits); users, sessions and the admin live in ``default``."""

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool:
        return db == "default" or app_label in ("idemmail", "django_shop")


def mariadb_database(ns: str) -> sa.URL:
    """A MariaDB database of its own (Django's migrations create every app's tables)."""
    try:
        ddl(MARIADB_URL, f"CREATE DATABASE `{ns}`")
    except Exception as exc:
        service_missing("mariadb", exc)
    return sa.make_url(MARIADB_URL).set(database=ns)


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    require_module("django")
    ns = unique("dj").replace("_", "")
    r, url = web_services(ns)
    pg = url.set(drivername="postgresql")  # Django's spelling: the settings' database() reads it
    fake = FakeProvider(dedupe=False).start()
    env = {
        "DJANGO_SETTINGS_MODULE": "examples.django_shop.settings",
        "CELERY_BROKER_URL": REDIS_URL, "CELERY_RESULT_BACKEND": REDIS_URL, "CELERY_TASK_DEFAULT_QUEUE": f"q.{ns}",
        "SHOP_DATABASE_URL": pg.render_as_string(hide_password=False),
        "SHOP_LEDGER_URL": REDIS_URL, "SHOP_LEDGER_PREFIX": f"led.{ns}", "SHOP_KEY_SECRET": "test-secret",
        "SHOP_PROVIDER_URL": fake.url, "SHOP_PROVIDER_API_KEY": DEFAULT_API_KEY,
    }
    previous = current_app._get_current_object()
    tmp = tmp_path_factory.mktemp("django-shop")
    _setup_django(env, tmp / "shop.sqlite3", mariadb_database(ns))
    from django.core.management import call_command
    from django.db import connections

    for alias in ALIASES:
        call_command("migrate", database=alias, verbosity=0)
    from examples.django_shop import celery_app

    shop = Shop(celery_app, fake, from_url(REDIS_URL, prefix=f"led.{ns}"), env)

    def count(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if headers and "id" in headers:
            shop.published[headers["id"]] = str(sender)

    before_task_publish.connect(count, weak=False)
    try:
        with celery_worker("examples.django_shop", env, log=tmp / "worker.log", args=("-P", "prefork", "-c", "2")):
            yield shop
    finally:
        before_task_publish.disconnect(count)
        fake.stop()
        connections.close_all()
        previous.set_current()
        drop_schema(ns)
        ddl(MARIADB_URL, f"DROP DATABASE IF EXISTS `{ns}`")
        r.delete(*r.scan_iter(f"led.{ns}:*", count=1000), f"q.{ns}", f"_kombu.binding.q.{ns}",
                 *(f"celery-task-meta-{t}" for t in shop.published))


def test_the_apps_migrations_go_down_and_up_on_postgresql_sqlite_and_mariadb(shop: Shop) -> None:
    """``migrate idemmail zero`` drops the relay's table, ``migrate idemmail`` makes it again, column for column,
    with its unique key (what ``ON CONFLICT`` targets), on each database; the model reads and writes it after."""
    from django.core.management import call_command
    from django.db.migrations.recorder import MigrationRecorder

    from idemmail_celery.contrib.django.models import OutboxRow
    from idemmail_celery.outbox import outbox_table

    expected = {c.name for c in outbox_table().columns}
    for alias in ALIASES:
        engine = sa.create_engine(shop.relay_url(alias))
        try:
            call_command("migrate", "idemmail", "zero", database=alias, verbosity=0)
            assert not sa.inspect(engine).has_table("idemmail_outbox"), alias
            assert not MigrationRecorder(connections_of(alias)).migration_qs.filter(app="idemmail").exists(), alias
            call_command("migrate", "idemmail", database=alias, verbosity=0)
            inspector = sa.inspect(engine)
            assert {c["name"] for c in inspector.get_columns("idemmail_outbox")} == expected, alias
            applied = MigrationRecorder(connections_of(alias)).applied_migrations()
            assert ("idemmail", "0001_initial") in applied, alias
            assert OutboxRow.objects.using(alias).count() == 0, alias  # the model reads the table made again
        finally:
            engine.dispose()


def connections_of(alias: str) -> Any:
    from django.db import connections

    return connections[alias]


def outbox_rows(alias: str, key: str) -> list[str]:
    from idemmail_celery.contrib.django.models import OutboxRow

    return list(OutboxRow.objects.using(alias).filter(intent_key=key).values_list("state", flat=True))


def test_the_project_reads_both_spellings_of_the_settings_and_registers_send_email(shop: Shop) -> None:
    conf = shop.app.conf
    assert conf.idemmail_default_from == "Shop <shop@example.com>"  # plain IDEMMAIL_DEFAULT_FROM
    assert conf.idemmail_ledger_options == {"prefix": shop.ledger.prefix}  # CELERY_IDEMMAIL_LEDGER_OPTIONS
    assert {"idemmail_celery.send_email", "idemmail_celery.send_campaign",
            "idemmail_celery.outbox_relay"} <= set(shop.app.tasks)


def test_the_migration_makes_the_relays_table_and_matches_the_models(shop: Shop) -> None:
    from django.core.management import call_command

    from idemmail_celery.outbox import outbox_table

    call_command("makemigrations", "idemmail", "django_shop", check=True, dry_run=True, verbosity=0)  # exits if not
    expected = {c.name for c in outbox_table().columns}
    for alias in ALIASES:
        engine = sa.create_engine(shop.relay_url(alias))
        try:
            inspector = sa.inspect(engine)
            columns = {c["name"]: c for c in inspector.get_columns("idemmail_outbox")}
            assert set(columns) == expected, alias
            unique = [u["column_names"] for u in inspector.get_unique_constraints("idemmail_outbox")] + [
                i["column_names"] for i in inspector.get_indexes("idemmail_outbox") if i.get("unique")]
            assert unique and all(names == ["intent_key"] for names in unique), alias  # ON CONFLICT's target
            if alias == "default":  # naive UTC, as the relay compares it: no time zone on the column
                assert not columns["next_attempt_at"]["type"].timezone
        finally:
            engine.dispose()


def test_another_app_in_the_process_keeps_its_own_relay(shop: Shop) -> None:
    """The project's relay is its app's alone: a shared task would take the name on every app made later."""
    from celery import Celery

    from idemmail_celery.outbox import RELAY_TASK, register_relay

    other = Celery(unique("other"), set_as_current=False)
    register_relay(other, "sqlite:///elsewhere.sqlite3")
    assert other.tasks[RELAY_TASK].run.__qualname__ == "register_relay.<locals>.outbox_relay"
    assert shop.app.tasks[RELAY_TASK].run.__qualname__ == "register_relay_task.<locals>.outbox_relay"


@pytest.mark.parametrize("alias", ALIASES)
def test_a_rolled_back_order_leaves_no_row_and_sends_nothing(shop: Shop, alias: str) -> None:
    from examples.django_shop.models import Order

    email = f"roll-{alias}@example.com"
    assert shop.order(alias, email, out_of_stock=True) is None
    assert not Order.objects.using(alias).filter(email=email).exists()
    key = shop.key(to=email, event_id="order-1", template="order_confirmation")  # any id: no row has this address
    from idemmail_celery.contrib.django.models import OutboxRow

    assert not [row for row in OutboxRow.objects.using(alias).values_list("kwargs", flat=True) if email in row]
    run_relay(shop.app, shop.relay_url(alias))  # publishes nothing of this order's
    assert all(email not in d.recipients for d in shop.fake.deliveries())
    assert shop.ledger.get(key) is None


@pytest.mark.parametrize("alias", ALIASES)
def test_a_committed_order_sends_exactly_one_email(shop: Shop, alias: str) -> None:
    email = f"commit-{alias}@example.com"
    order_id = shop.order(alias, email)
    key = shop.key(to=email, event_id=f"order-{order_id}", template="order_confirmation")
    assert outbox_rows(alias, key) == ["pending"]  # committed with the order; nothing published yet
    if alias == "default":
        shop.app.tasks["idemmail_celery.outbox_relay"].delay()  # what beat runs, in the worker: its URL from Django's
    else:
        run_relay(shop.app, shop.relay_url(alias))
    wait_for(lambda: shop.sent(key), timeout=60)
    run_relay(shop.app, shop.relay_url(alias))  # a later relay run finds nothing left to publish
    assert outbox_rows(alias, key) == ["dispatched"]
    assert shop.fake.delivery_count(key) == 1
    assert [d.subject for d in shop.fake.deliveries() if email in d.recipients] == [f"Order {order_id} confirmed"]


@pytest.mark.parametrize("alias", ALIASES)
def test_a_relay_that_fails_before_its_commit_publishes_again_and_the_copy_replays_duplicate(
    shop: Shop, alias: str
) -> None:
    email = f"relay-{alias}@example.com"
    order_id = shop.order(alias, email)
    key = shop.key(to=email, event_id=f"order-{order_id}", template="order_confirmation")
    engine = sa.create_engine(shop.relay_url(alias))

    def crash(ids: Any) -> None:
        raise ConnectionError("the relay's database went away before its commit")

    before = set(shop.published)
    with pytest.raises(ConnectionError):
        relay(engine, shop.app, before_commit=crash)
    assert outbox_rows(alias, key) == ["pending"]  # published, not marked: the next run publishes it again
    assert relay(engine, shop.app) >= 1
    engine.dispose()
    assert outbox_rows(alias, key) == ["dispatched"]
    copies = [t for t in shop.published if t not in before and shop.published[t].endswith("send_email")]
    outcomes = results([AsyncResult(t, app=shop.app) for t in copies], timeout=90)
    mine = [o for o in outcomes if isinstance(o, dict) and o.get("key") == key]
    assert sorted(o["status"] for o in mine) == ["duplicate", "sent"]
    assert shop.fake.delivery_count(key) == 1


def test_a_nudge_asks_for_a_relay_run_after_the_commit_and_not_after_a_rollback(shop: Shop) -> None:
    from django.db import transaction

    from idemmail_celery.contrib.django.outbox import enqueue_email

    def relay_runs() -> int:
        return sum(name == "idemmail_celery.outbox_relay" for name in shop.published.values())

    before = relay_runs()
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        enqueue_email(nudge=True, to="nudge-no@example.com", subject="S", text="T", event_id="n-1", template="t")
        1 / 0  # noqa: B018
    assert relay_runs() == before
    with transaction.atomic():
        key = enqueue_email(nudge=True, to="nudge@example.com", subject="S", text="T", event_id="n-2", template="t")
        assert relay_runs() == before  # not while the transaction is open
    assert relay_runs() == before + 1
    wait_for(lambda: shop.sent(key), timeout=60)  # the worker's relay run published it; no beat here
    assert shop.fake.delivery_count(key) == 1


def test_manage_py_check_flags_a_missing_key_secret(tmp_path: Path) -> None:
    require_module("django")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMMAIL_", "SHOP_", "DJANGO_"))}
    env["SHOP_DATABASE_URL"] = f"sqlite:///{tmp_path / 'check.sqlite3'}"
    cmd = [sys.executable, "examples/django_shop/manage.py", "check"]
    missing = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert "(idemmail.E001) IDEMMAIL_KEY_SECRET is not set" in missing.stderr
    given = subprocess.run(cmd, cwd=ROOT, env={**env, "SHOP_KEY_SECRET": "s3cret"}, capture_output=True, text=True,
                           timeout=120)
    assert given.returncode == 0, given.stderr
    assert "idemmail" not in given.stdout + given.stderr


@pytest.mark.parametrize(("url", "key", "says"), [
    ("smtp://127.0.0.1:2525", "sekrit-9d2e", "idemmail_provider_url (smtp://...) cannot be used: an SMTP password "
                                            "was given (idemmail_provider_api_key) but the URL names no user"),
    ("smtpx://127.0.0.1", "sekrit-9d2e", "idemmail_provider_url (smtpx://...) cannot be used: no email provider"),
    ("resend://", "", "idemmail_provider_url (resend://...) cannot be used: the HTTP email provider needs an API key"),
], ids=["smtp-password-without-user", "unknown-scheme", "missing-api-key"])
def test_manage_py_check_fails_on_a_provider_that_cannot_be_built(tmp_path: Path, url: str, key: str,
                                                                   says: str) -> None:
    require_module("django")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMMAIL_", "SHOP_", "DJANGO_", "RESEND_"))}
    env.update(SHOP_DATABASE_URL=f"sqlite:///{tmp_path / 'check.sqlite3'}", SHOP_KEY_SECRET="s3cret",
               SHOP_PROVIDER_URL=url, SHOP_PROVIDER_API_KEY=key)
    cmd = [sys.executable, "examples/django_shop/manage.py", "check"]
    failed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1
    assert f"IDEMMAIL_PROVIDER_URL: (idemmail.E007) {says}" in failed.stderr, failed.stderr
    assert "sekrit" not in failed.stdout + failed.stderr


def test_manage_py_check_passes_a_provider_that_builds(tmp_path: Path) -> None:
    require_module("django")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMMAIL_", "SHOP_", "DJANGO_", "RESEND_"))}
    env.update(SHOP_DATABASE_URL=f"sqlite:///{tmp_path / 'check.sqlite3'}", SHOP_KEY_SECRET="s3cret",
               SHOP_PROVIDER_URL="smtp://shop@127.0.0.1:2525", SHOP_PROVIDER_API_KEY="sekrit-9d2e")
    given = subprocess.run([sys.executable, "examples/django_shop/manage.py", "check"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert given.returncode == 0, given.stderr
    assert "idemmail" not in given.stdout + given.stderr


def test_a_table_made_by_hand_from_schema_sql_is_adopted_with_fake_initial(tmp_path: Path) -> None:
    """The earlier recipe ran ``schema_sql()`` in a migration of the project's own: the model's is the same table."""
    require_module("django")
    import sqlite3

    from idemmail_celery.outbox import schema_sql

    db = tmp_path / "old.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.executescript(schema_sql("sqlite"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMMAIL_", "SHOP_", "DJANGO_"))}
    env.update(SHOP_DATABASE_URL=f"sqlite:///{db}", SHOP_KEY_SECRET="s3cret")
    cmd = [sys.executable, "examples/django_shop/manage.py", "migrate", "idemmail", "--fake-initial"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Applying idemmail.0001_initial... FAKED" in done.stdout


def test_the_checks_name_each_wrong_setting(shop: Shop) -> None:
    from django.test import override_settings

    from idemmail_celery.contrib.django.checks import check_settings

    with override_settings(IDEMMAIL_LEASE_SECONDS="soon", IDEMMAIL_KEY_SECRT="typo",
                           CELERY_IDEMMAIL_DEFAULT_FROM="a@example.com", IDEMMAIL_DEFAULT_FROM="b@example.com"):
        found = {(m.id, m.obj) for m in check_settings()}
    assert found == {("idemmail.E002", "IDEMMAIL_LEASE_SECONDS"), ("idemmail.E005", "IDEMMAIL_KEY_SECRT"),
                     ("idemmail.E006", "IDEMMAIL_DEFAULT_FROM")}
    assert check_settings() == []


# -- the review queue in the admin --


def park(shop: Shop, to: str, ledger: Ledger | None = None) -> str:
    """A send_email intent parked for review (a holder died mid-send), with its first payload stored
    (in the project's ledger unless ``ledger`` is given)."""
    led = ledger or shop.ledger
    send = shop.app.tasks["idemmail_celery.send_email"]
    kwargs = {"to": to, "subject": "Your receipt", "text": "Thanks.", "event_id": f"receipt-{uuid.uuid4().hex[:6]}",
              "template": "receipt"}
    key: str = send.intent_key(**kwargs)
    c = led.claim(ClaimRequest(key=key, task_name=send.name, fingerprint="f",
                               payload=send.key_builder.payload((), kwargs).to_json()))
    led.park(key, c.token, {"type": "SendNeedsReview", "reason": "lease_expired"})
    return key


def staff(username: str, *perms: str) -> Any:
    from django.contrib.auth.models import Permission, User

    user = User.objects.create_user(username, password="pw-" + username, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="idemmail", codename__in=perms))
    return User.objects.get(pk=user.pk)  # fresh: permissions are cached on the instance


def test_the_admin_lists_a_parked_intent_and_a_staff_user_releases_it_once(
    shop: Shop, caplog: pytest.LogCaptureFixture
) -> None:
    from django.test import Client

    key = park(shop, "parked@example.com")
    viewer, operator = Client(), Client()
    viewer.force_login(staff("viewer", "view_reviewrecord"))
    operator.force_login(staff("operator", "view_reviewrecord", "release"))

    listing = viewer.get("/admin/idemmail/reviewrecord/", {"state": "review"})
    assert listing.status_code == 200 and key in listing.content.decode()
    page = viewer.get("/admin/idemmail/reviewrecord/record/", {"key": key}).content.decode()
    assert "parked@example.com" not in page and "(redacted: personal data)" in page  # no payload by default
    assert "Release for a resend" not in page  # no button without the permission
    assert viewer.get("/admin/idemmail/reviewrecord/record/", {"key": key, "payload": "1"}).content.decode().count(
        "parked@example.com") == 0  # asking is not enough: idemmail.view_payload
    refused = viewer.post("/admin/idemmail/reviewrecord/record/release/", {"key": key, "note": "resend"})
    assert refused.status_code == 403
    assert shop.ledger.get(key).state is State.REVIEW  # type: ignore[union-attr]

    with caplog.at_level(logging.INFO, logger="idemmail_celery.audit"):
        done = operator.post("/admin/idemmail/reviewrecord/record/release/",
                             {"key": key, "note": "provider says not delivered"}, follow=True)
    assert done.status_code == 200 and "released (re-enqueued)" in done.content.decode()
    assert [r.getMessage() for r in caplog.records if r.name == "idemmail_celery.audit"] == [
        f"idemmail admin: release on {key} refused: viewer lacks idemmail.release",
        f"idemmail admin: release on {key} by operator (django admin): released (re-enqueued)"]
    wait_for(lambda: shop.sent(key), timeout=60)  # the worker sent the stored first payload
    assert shop.fake.delivery_count(key) == 1
    record = shop.ledger.get(key)
    assert record is not None and record.error is not None
    assert record.resolution["by"] == "operator (django admin)"

    again = operator.post("/admin/idemmail/reviewrecord/record/release/", {"key": key, "note": "again"}, follow=True)
    assert "it was sent; left unchanged" in again.content.decode()  # the CLI's rule, the CLI's words
    assert shop.fake.delivery_count(key) == 1


def test_the_admins_other_actions_follow_the_clis_rules(shop: Shop) -> None:
    """Forget, show the payload (its own permission), mark sent with the provider's id; a sent record refuses."""
    from django.test import Client

    key = park(shop, "other@example.com")
    clerk = Client()
    clerk.force_login(staff("clerk", "view_reviewrecord", "view_payload", "mark_sent", "forget_payload"))
    record_url = "/admin/idemmail/reviewrecord/record/"
    assert "other@example.com" in clerk.get(record_url, {"key": key, "payload": "1"}).content.decode()
    assert clerk.get(record_url + "sent/", {"key": key}).status_code == 405  # an action is a POST

    forgot = clerk.post(record_url + "forget/", {"key": key}, follow=True).content.decode()
    assert f"{key[1:]}: payload erased" in forgot and "(none stored)" in forgot  # the admin capitalises
    record = shop.ledger.get(key)
    assert record is not None and record.payload is None and record.state is State.REVIEW

    sent = clerk.post(record_url + "sent/", {"key": key, "note": "in the provider's log", "message_id": "msg-1"},
                      follow=True).content.decode()
    assert f"{key[1:]}: sent" in sent
    record = shop.ledger.get(key)
    assert record is not None and record.state is State.SENT and record.result is not None
    assert record.result["message_id"] == "msg-1"

    assert clerk.post(record_url + "failed/", {"key": key, "note": "no"}).status_code == 403  # not this clerk's
    again = clerk.post(record_url + "sent/", {"key": key, "note": "twice"}, follow=True).content.decode()
    assert "it cannot be resolved" in again  # the ledger's rule, as the CLI shows it
    unnoted = clerk.post(record_url + "sent/", {"key": park(shop, "n@example.com")}, follow=True).content.decode()
    assert "Say why in the note" in unnoted
    assert shop.fake.delivery_count(key) == 0


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_ledger(shop: Shop, request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    """The project's ledger setting pointed at a SQL ledger, for the admin in this process (the worker keeps
    the Redis one: nothing here goes through it)."""
    from idemmail_celery.contrib.django import admin as review_admin

    table = unique("adm")
    url = f"sqlite:///{tmp_path / 'ledger.sqlite3'}" if request.param == "sqlite" else POSTGRES_URL
    ledger = from_url(url, table=table)
    try:
        ledger.ping()
    except Exception as exc:
        service_missing(request.param, exc)
    monkeypatch.setitem(shop.app.conf, "idemmail_ledger_url", url)
    monkeypatch.setitem(shop.app.conf, "idemmail_ledger_options", {"table": table})
    monkeypatch.setattr(review_admin, "_operators", {})  # the admin opens the ledger the setting names
    try:
        yield ledger
    finally:
        ledger.drop_table()  # type: ignore[attr-defined]
        ledger.close()


def test_the_admin_lists_and_resolves_a_parked_intent_on_a_sql_ledger(
    shop: Shop, sql_ledger: Ledger, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """The review queue reads whatever ledger the project names (it lists through the Ledger API): here
    SQLite and PostgreSQL, with the same redaction, permission and audit line as on Redis."""
    from django.test import Client

    key = park(shop, "sql.parked@example.com", sql_ledger)
    assert shop.ledger.get(key) is None  # not in the Redis ledger: what the admin shows below is the SQL one's
    name = f"sqlclerk{request.node.callspec.params['sql_ledger']}"
    clerk = Client()
    clerk.force_login(staff(name, "view_reviewrecord", "mark_failed"))
    listing = clerk.get("/admin/idemmail/reviewrecord/", {"state": "review"}).content.decode()
    assert key in listing
    page = clerk.get("/admin/idemmail/reviewrecord/record/", {"key": key}).content.decode()
    assert "sql.parked@example.com" not in page and "(redacted: personal data)" in page
    with caplog.at_level(logging.INFO, logger="idemmail_celery.audit"):
        done = clerk.post("/admin/idemmail/reviewrecord/record/failed/", {"key": key, "note": "customer cancelled"},
                          follow=True)
    assert done.status_code == 200 and f"{key[1:]}: failed" in done.content.decode()
    record = sql_ledger.get(key)
    assert record is not None and record.state is State.FAILED
    assert [r.getMessage() for r in caplog.records if r.name == "idemmail_celery.audit"] == [
        f"idemmail admin: failed on {key} by {name} (django admin): failed"]
    assert shop.fake.delivery_count(key) == 0


@contextmanager
def headless_chromium(window_size: str, artifact: str) -> Iterator[tuple[Any, str]]:
    """Headless Chromium (``window_size`` as ``"width,height"``) and a live server of this process's Django
    (static files served): yields the browser and the server's base URL. A failure in the ``with`` block saves
    the page as ``test-artifacts/<artifact>-failed.png`` and ``.html``; browser, server and profile always go."""
    webdriver = require_module("selenium.webdriver")
    if not Path("/usr/bin/chromedriver").exists():
        service_missing("chromedriver", FileNotFoundError("/usr/bin/chromedriver (apt-get install chromium-driver)"))
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.test.testcases import LiveServerThread

    server = LiveServerThread("127.0.0.1", StaticFilesHandler)
    server.daemon = True
    server.start()
    server.is_ready.wait()
    if server.error:
        raise server.error
    options = webdriver.ChromeOptions()
    profile = ARTIFACTS / f"chromium-profile-{uuid.uuid4().hex[:8]}"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                 f"--user-data-dir={profile}", f"--window-size={window_size}"):
        options.add_argument(flag)
    options.binary_location = "/usr/bin/chromium"
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService("/usr/bin/chromedriver"))
    browser.implicitly_wait(30)  # each find waits for the page a click opened
    try:
        yield browser, f"http://127.0.0.1:{server.port}"
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / f"{artifact}-failed.png"))
        (ARTIFACTS / f"{artifact}-failed.html").write_text(browser.page_source)
        raise
    finally:
        browser.quit()
        server.terminate()
        server.join(timeout=15)
        subprocess.run(["rm", "-rf", str(profile)], check=False)


def test_a_staff_user_marks_a_parked_intent_failed_in_headless_chromium(
    shop: Shop, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end in a browser: log in, filter the review queue, open the record, mark it failed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.wait import WebDriverWait

    key = park(shop, "browser@example.com")
    staff("browser", "view_reviewrecord", "mark_failed")
    with headless_chromium("1280,900", "django-admin-review") as (browser, base):
        browser.get(f"{base}/admin/login/?next=/admin/idemmail/reviewrecord/")
        browser.find_element(By.NAME, "username").send_keys("browser")
        browser.find_element(By.NAME, "password").send_keys("pw-browser")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        browser.find_element(By.PARTIAL_LINK_TEXT, "review (").click()  # the filter, with its count
        browser.find_element(By.LINK_TEXT, key).click()
        assert "browser@example.com" not in browser.page_source
        browser.find_element(By.ID, "note-failed").send_keys("customer cancelled; do not send")
        browser.find_element(By.NAME, "do-failed").click()
        done = WebDriverWait(browser, 30).until(  # the record's page again, with the action's message
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "ul.messagelist li.success")))
        assert done.text.endswith(f"{key[1:]}: failed")
        assert browser.find_element(By.ID, "record-state").text == "failed"
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "django-admin-review.png"
        assert browser.save_screenshot(str(shot))
        with capsys.disabled():
            print(f"\nscreenshot of the admin's review queue: {shot}")
    record = shop.ledger.get(key)
    assert record is not None and record.state is State.FAILED
    assert record.resolution is not None and record.resolution["by"] == "browser (django admin)"
    assert shop.fake.delivery_count(key) == 0


def test_a_key_that_is_not_a_ledger_key_is_a_400_and_no_forged_line_reaches_the_audit_log(
    shop: Shop, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 35, item 6: a view-only user's POST with a newline in the key wrote a well-formed audit line saying
    root released another record. The key's shape is checked first: 400, before the refusal's audit line."""
    from django.test import Client

    key, other = park(shop, "forge.a@example.com"), park(shop, "forge.b@example.com")
    viewer = Client()
    viewer.force_login(staff("forger", "view_reviewrecord"))
    forged = f"{key}\nidemmail admin: release on {other} by root (django admin): released (re-enqueued)"
    with caplog.at_level(logging.INFO, logger="idemmail_celery.audit"):
        posted = viewer.post("/admin/idemmail/reviewrecord/record/release/", {"key": forged, "note": "x"})
        shown = viewer.get("/admin/idemmail/reviewrecord/record/", {"key": forged})
        upper = viewer.post("/admin/idemmail/reviewrecord/record/release/", {"key": key.upper(), "note": "x"})
    assert (posted.status_code, shown.status_code, upper.status_code) == (400, 400, 400)
    assert [r.getMessage() for r in caplog.records if r.name == "idemmail_celery.audit"] == []
    for k in (key, other):
        record = shop.ledger.get(k)
        assert record is not None and record.state is State.REVIEW
    assert shop.fake.delivery_count(other) == 0


def test_an_audit_line_is_one_line_whatever_the_user_is_called(shop: Shop, caplog: pytest.LogCaptureFixture) -> None:
    from django.test import Client

    key = park(shop, "one.line@example.com")
    name = "mallory\nidemmail admin: release by root"  # no validator stops a name made in code or by an IdP
    clerk = Client()
    clerk.force_login(staff(name, "view_reviewrecord"))
    with caplog.at_level(logging.INFO, logger="idemmail_celery.audit"):
        refused = clerk.post("/admin/idemmail/reviewrecord/record/release/", {"key": key, "note": "x"})
    assert refused.status_code == 403
    assert [r.getMessage() for r in caplog.records if r.name == "idemmail_celery.audit"] == [
        f'idemmail admin: release on {key} refused: "mallory\\nidemmail admin: release by root" lacks idemmail.release']


# -- the review queue at scale: pages, search, filters, order, bulk actions (issue 32) --


@dataclass
class Queue:
    """A ledger of its own the admin reads (the project's setting pointed at it), with parked send_email intents."""

    shop: Shop
    ledger: Ledger
    backend: str
    keys: list[str] = field(default_factory=list)

    def park(self, n: int, *, first: int = 0, reason: Any = None) -> list[str]:
        """``n`` send_email intents parked in this order: record ``i`` for order ``i``, to ``c<i>@shop<i % 3>.test``,
        template receipt or welcome, reason lease_expired or after_data (``reason(i)``)."""
        send = self.shop.app.tasks["idemmail_celery.send_email"]
        made = []
        for i in range(first, first + n):
            kwargs = {"to": f"c{i}@shop{i % 3}.test", "subject": f"Private subject {i}", "text": "Dear customer",
                      "event_id": f"order-{i}", "template": ("receipt", "welcome")[i % 2],
                      "tags": {"campaign": "winter"}}
            made.append((send.intent_key(**kwargs), send.key_builder.payload((), kwargs).to_json()))
        for start in range(0, len(made), 100):
            batch = made[start:start + 100]
            claims = self.ledger.claim_many([ClaimRequest(key=k, task_name=send.name, fingerprint="f", payload=p)
                                             for k, p in batch])
            for n_in, ((k, _), c) in enumerate(zip(batch, claims, strict=True)):
                i = first + start + n_in
                why = reason(i) if reason else ("lease_expired", "after_data")[i % 2]
                self.ledger.park(k, c.token, {"type": "SendNeedsReview", "reason": why, "at": time.time(),
                                              "message": "outcome unknown: the worker died after the provider call"})
        self.keys += [k for k, _ in made]
        return [k for k, _ in made]

    def state(self, key: str) -> State:
        record = self.ledger.get(key)
        assert record is not None
        return record.state


@pytest.fixture(params=["redis", "postgresql"])
def queue(shop: Shop, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Queue]:
    from idemmail_celery.contrib.django import admin as review_admin

    name = unique("adq")
    url, options = (REDIS_URL, {"prefix": name}) if request.param == "redis" else (POSTGRES_URL, {"table": name})
    ledger = from_url(url, **options)
    try:
        ledger.ping()
    except Exception as exc:
        service_missing(request.param, exc)
    monkeypatch.setitem(shop.app.conf, "idemmail_ledger_url", url)
    monkeypatch.setitem(shop.app.conf, "idemmail_ledger_options", options)
    monkeypatch.setattr(review_admin, "_operators", {})  # the admin opens the ledger the setting names
    review_admin.summaries.forget()
    try:
        yield Queue(shop, ledger, request.param)
    finally:
        review_admin.summaries.forget()
        if request.param == "redis":
            r = ledger.client  # type: ignore[attr-defined]
            names = list(r.scan_iter(f"{name}:*", count=1000))
            for i in range(0, len(names), 500):
                r.delete(*names[i:i + 500])
        else:
            ledger.drop_table()  # type: ignore[attr-defined]
        ledger.close()


LIST = "/admin/idemmail/reviewrecord/"


def rows(page: Any) -> list[str]:
    """The keys of a list page's rows, in order (each written whole, with a place to wrap in its middle)."""
    return ["".join(halves) for halves in re.findall(r'class="idemmail-key">([0-9a-f]{32})<wbr>([0-9a-f]{32})<',
                                                         page.content.decode())]


def test_the_review_queue_pages_by_number_and_by_cursor(queue: Queue) -> None:
    from django.test import Client

    keys = queue.park(230)
    viewer = Client()
    viewer.force_login(staff(f"pager-{queue.backend}", "view_reviewrecord"))
    first = viewer.get(LIST)
    html = first.content.decode()
    assert first.status_code == 200 and rows(first) == keys[:100]  # review, oldest first: the queue's front
    assert "records 1-100 of 230" in html and 'href="?p=2"' in html and 'href="?p=3"' in html
    assert rows(viewer.get(LIST, {"p": 2})) == keys[100:200]
    last = viewer.get(LIST, {"p": 3})
    assert rows(last) == keys[200:] and 'id="next-page"' not in last.content.decode()
    follow = re.search(r'href="([^"]+)" id="next-page"', html)
    assert follow is not None and "c=" in follow.group(1)  # the next page walks on from this one's last record
    assert rows(viewer.get(LIST + follow.group(1).replace("&amp;", "&"))) == keys[100:200]
    assert rows(viewer.get(LIST, {"o": "-updated"}))[:3] == keys[::-1][:3]
    assert rows(viewer.get(LIST, {"p": 9})) == []  # past the end: an empty page, not an error
    past = viewer.get(LIST, {"p": 10**22})  # an offset no store's integers hold: was a 500 (Redis, SQLite)
    assert past.status_code == 200 and rows(past) == [] and "errornote" not in past.content.decode()
    assert rows(viewer.get(LIST, {"p": "x"})) == keys[:100]


def test_the_review_queue_searches_and_filters_in_the_sidebar(queue: Queue) -> None:
    from django.test import Client

    keys = queue.park(120)
    old = time.time() - 10 * 86400
    for k in keys[:3]:  # parked ten days ago
        record = queue.ledger.get(k)
        assert record is not None
        queue.ledger._force(k, record.token, replace(record, token=record.token + 1, updated_at=old))
    viewer = Client()
    viewer.force_login(staff(f"finder-{queue.backend}", "view_reviewrecord"))

    def found(**params: Any) -> list[str]:
        page = viewer.get(LIST, params)
        assert page.status_code == 200
        return rows(page)

    assert found(q="order-17") == [keys[17]]  # the event id
    assert found(q=keys[42][:10]) == [keys[42]]  # the start of a key
    got = found(q="welcome shop2.test")
    want = [k for i, k in enumerate(keys) if i % 2 and i % 3 == 2][:100]
    assert got == want, [str(label_of(queue.ledger.get(k))) for k in got if k not in want]  # type: ignore[arg-type]
    assert found(q="c17@shop2.test") == [] and found(q="Private") == []  # an address, a subject: never
    assert found(reason="after_data") == [k for i, k in enumerate(keys) if i % 2][:100]
    assert found(reason="after_data", q="order-109") == [keys[109]]
    assert found(reason="lease_expired", q="order-109") == []
    assert found(task="idemmail_celery.send_email", age="older-7d") == sorted(keys[:3])  # tied times: by key
    assert found(age="24h") == keys[3:103]
    assert found(state="sent") == [] and found(state="nonsense") == found()
    html = viewer.get(LIST).content.decode()
    assert "after_data (60)" in html and "lease_expired (60)" in html and "review (120)" in html  # the facets
    day = dt.datetime.fromtimestamp(old, dt.timezone.utc)
    assert f"updated__year={day.year}" in html  # the date hierarchy offers the years with records
    by_day = found(updated__year=day.year, updated__month=day.month, updated__day=day.day)
    assert by_day == sorted(keys[:3])
    last = viewer.get(LIST, {"updated__year": 9999, "updated__month": 12, "updated__day": 31})  # ends past 9999
    assert last.status_code == 200 and "the date: not a date, left out" in last.content.decode()
    for private in ("c5@shop2.test", "Private subject", "Dear customer"):
        assert private not in html
    assert "welcome · order-1 · campaign=winter · @shop1.test" in html  # a row's label: which send, no person


def test_a_bulk_action_resolves_the_ticked_records_with_one_note(queue: Queue,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from django.test import Client

    keys = queue.park(12)
    clerk = Client()
    name = f"bulk-{queue.backend}"
    clerk.force_login(staff(name, "view_reviewrecord", "mark_failed", "mark_sent"))
    page = clerk.get(LIST).content.decode()
    assert page.count('class="action-select"') == 12 and 'value="failed">Resolve as failed' in page
    assert 'value="release"' not in page  # no permission, no action
    with caplog.at_level(logging.INFO, logger="idemmail_celery.audit"):
        done = clerk.post(LIST, {"action": "failed", "_selected_action": keys[:3], "note": "incident 42: cancelled"},
                          follow=True)
    assert done.status_code == 200
    assert "Resolve as failed: 3 of 3 records, the note kept with each." in done.content.decode()
    for k in keys[:3]:
        record = queue.ledger.get(k)
        assert record is not None and record.state is State.FAILED and record.error is not None
        assert record.resolution["note"] == "incident 42: cancelled"
        assert record.resolution["by"] == f"{name} (django admin)"
    assert [r.getMessage() for r in caplog.records if r.name == "idemmail_celery.audit"] == [
        f"idemmail admin: failed on {k} by {name} (django admin): failed (bulk)" for k in keys[:3]]
    assert all(queue.state(k) is State.REVIEW for k in keys[3:])

    # "Select all": every record the filters match, on every page.
    across = clerk.post(LIST + "?reason=after_data", {"action": "sent", "select_across": "1", "note": "in the log",
                                                      "_selected_action": keys[5:6]}, follow=True)
    assert "Resolve as sent: 5 of 5 records" in across.content.decode()  # 1, 5, 7, 9, 11 (3 failed already)
    assert [queue.state(k) for k in keys] == [State.FAILED] * 3 + [
        State.SENT if i % 2 else State.REVIEW for i in range(3, 12)]
    unnoted = clerk.post(LIST, {"action": "failed", "_selected_action": keys[4:5]}, follow=True)
    assert "Say why in the note" in unnoted.content.decode() and queue.state(keys[4]) is State.REVIEW
    refused = clerk.post(LIST, {"action": "release", "_selected_action": keys[4:5], "note": "resend"})
    assert refused.status_code == 403 and queue.state(keys[4]) is State.REVIEW
    again = clerk.post(LIST, {"action": "failed", "_selected_action": keys[3:5], "note": "twice"},
                       follow=True).content.decode()  # keys[3] was sent: refused, and named; keys[4] goes ahead
    assert "Resolve as failed: 1 of 2 records" in again and f"Record {keys[3]}: record {keys[3]} is sent" in again


def test_a_view_only_user_lists_the_queue_and_cannot_act_on_it(queue: Queue,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from django.test import Client

    keys = queue.park(3)
    viewer = Client()
    viewer.force_login(staff(f"looker-{queue.backend}", "view_reviewrecord"))
    page = viewer.get(LIST).content.decode()
    assert rows(viewer.get(LIST)) == keys and "action-select" not in page and 'name="action"' not in page
    with caplog.at_level(logging.INFO, logger="idemmail_celery.audit"):
        refused = viewer.post(LIST, {"action": "failed", "_selected_action": keys, "note": "x"})
        forged = viewer.post(LIST, {"action": "failed", "_selected_action": [keys[0], keys[1] + "\nroot"], "note": "x"})
    assert (refused.status_code, forged.status_code) == (403, 400)
    assert [r.getMessage() for r in caplog.records if r.name == "idemmail_celery.audit"] == [
        f"idemmail admin: failed on 3 records refused: looker-{queue.backend} lacks idemmail.mark_failed"]
    assert all(queue.state(k) is State.REVIEW for k in keys)
    assert Client().get(LIST).status_code == 302  # not logged in: to the login page


def test_a_record_reads_as_a_person_reads_it(queue: Queue) -> None:
    """ISO times in the error, the full key as written (never capitalised), and the message id once it is sent."""
    from django.test import Client

    [key] = queue.park(1)
    clerk = Client()
    clerk.force_login(staff(f"reader-{queue.backend}", "view_reviewrecord", "mark_sent"))
    page = clerk.get(LIST + "record/", {"key": key}).content.decode()
    assert re.search(r"at&quot;: &quot;20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", page)  # not an epoch float
    assert not re.search(r"at&quot;: \d{10}\.\d+", page)
    assert "receipt · order-0 · campaign=winter · @shop0.test" in page
    done = clerk.post(LIST + "record/sent/", {"key": key, "note": "seen in the provider's log",
                                              "message_id": "msg-7f3a"}, follow=True).content.decode()
    assert f"Record {key}: sent" in done  # the whole key, as it is written: it can be pasted
    assert '<code id="record-message-id">msg-7f3a</code>' in done
    listed = clerk.get(LIST, {"state": "sent"}).content.decode()
    table = listed[listed.index("<tbody>"):listed.index("</tbody>")]
    assert key in table and "msg-7f3a" in table and "lease_expired" not in table  # the message id, not the reason
    assert "idemmail_celery.send_email" in table  # the task, also once it is sent


@pytest.mark.parametrize("queue", ["redis"], indirect=True)
def test_an_operator_pages_filters_and_resolves_many_records_at_once_in_headless_chromium(
    queue: Queue, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a browser: page on with the next link, filter by reason, tick two rows, resolve them with one note;
    then tick the page, take Django's "select all" offer and resolve every record the filter matches."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    keys = queue.park(130, reason=lambda i: "after_data" if i % 10 == 3 else "lease_expired")  # 13 after_data
    staff("bulkbrowser", "view_reviewrecord", "mark_failed")
    with headless_chromium("1600,1000", "django-admin-review-bulk") as (browser, base):

        def shown() -> list[str]:
            return [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#result_list a.idemmail-key")]

        browser.get(f"{base}/admin/login/?next={LIST}")
        browser.find_element(By.NAME, "username").send_keys("bulkbrowser")
        browser.find_element(By.NAME, "password").send_keys("pw-bulkbrowser")
        browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        assert "records 1-100 of 130" in browser.find_element(By.CSS_SELECTOR, "p.paginator").text
        assert shown() == keys[:100]
        browser.find_element(By.ID, "next-page").click()
        assert "records 101-130 of 130" in browser.find_element(By.CSS_SELECTOR, "p.paginator").text
        assert shown() == keys[100:]
        browser.find_element(By.PARTIAL_LINK_TEXT, "after_data (13)").click()  # the sidebar, with its count
        assert shown() == keys[3::10]
        for box in browser.find_elements(By.CSS_SELECTOR, "input.action-select")[:2]:
            box.click()
        assert browser.find_element(By.CSS_SELECTOR, "span.action-counter").text == "2 of 13 selected"
        Select(browser.find_element(By.NAME, "action")).select_by_value("failed")
        browser.find_element(By.ID, "bulk-note").send_keys("incident 7: orders cancelled")
        browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
        done = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li.success").text
        assert "Resolve as failed: 2 of 2 records" in done, done
        assert [queue.state(k) for k in keys[3:14:10]] == [State.FAILED] * 2
        assert shown() == keys[23::10]  # the filter kept: the eleven left

        queue.park(120, first=130, reason=lambda i: "after_data")  # more than a page match now
        browser.get(f"{base}{LIST}?reason=after_data")
        browser.find_element(By.ID, "action-toggle").click()  # the whole page...
        browser.find_element(By.CSS_SELECTOR, "span.question a").click()  # ... then "select all 131"
        Select(browser.find_element(By.NAME, "action")).select_by_value("failed")
        browser.find_element(By.ID, "bulk-note").send_keys("incident 7, the rest")
        browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
        done = browser.find_element(By.CSS_SELECTOR, "ul.messagelist li.success").text
        assert "Resolve as failed: 131 of 131 records" in done, done
        ARTIFACTS.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(ARTIFACTS / "django-admin-review-bulk.png"))
    left = [k for k in queue.keys if queue.state(k) is not State.FAILED]
    assert len(left) == 117 and all(queue.state(k) is State.REVIEW for k in left)


# -- Django's own email API through EMAIL_BACKEND = "idemmail_celery.contrib.django.EmailBackend" --


def new_sends(shop: Shop, before: set[str]) -> list[AsyncResult]:
    """The ``send_email`` messages this process published since ``before`` (the relay's are the worker's)."""
    return [AsyncResult(t, app=shop.app) for t in shop.published
            if t not in before and shop.published[t].endswith("send_email")]


def delivered_to(shop: Shop, address: str) -> list[Any]:
    return [d for d in shop.fake.deliveries() if any(address in r for r in d.recipients)]


def test_djangos_password_reset_view_sends_one_email_through_the_backend(shop: Shop) -> None:
    from django.contrib.auth.models import User
    from django.test import Client

    address = f"reset-{uuid.uuid4().hex[:8]}@example.com"
    User.objects.create_user(username=address, email=address, password="correct horse battery staple")
    before = set(shop.published)
    reply = Client().post("/accounts/password_reset/", {"email": address})
    assert reply.status_code == 302 and reply["Location"] == "/accounts/password_reset/done/"
    sends = new_sends(shop, before)
    assert len(sends) == 1  # published at once: the view runs in autocommit
    assert [o["status"] for o in results(sends, timeout=90)] == ["sent"]
    [delivery] = delivered_to(shop, address)
    assert delivery.subject.startswith("Password reset on") and delivery.recipients == (address,)


def test_the_same_message_sent_again_by_a_retried_view_is_one_email(shop: Shop) -> None:
    from django.core.mail import EmailMultiAlternatives

    address = f"retry-{uuid.uuid4().hex[:8]}@example.com"

    def send() -> int:
        message = EmailMultiAlternatives("Your invoice", "Invoice 7 is attached.", None, [address],
                                         cc=["books@example.com"], reply_to=["billing@example.com"])
        message.attach_alternative("<p>Invoice 7 is attached.</p>", "text/html")
        message.attach("invoice-7.txt", "total: 42.00", "text/plain")
        return message.send()

    before = set(shop.published)
    assert send() + send() == 2  # each call enqueued; the ledger decides which one sends
    sends = new_sends(shop, before)
    assert sorted(o["status"] for o in results(sends, timeout=90)) == ["duplicate", "sent"]
    assert len({o["key"] for o in results(sends, timeout=5)}) == 1
    assert len(delivered_to(shop, address)) == 1


def test_a_sign_up_form_posted_twice_sends_one_welcome_email(shop: Shop) -> None:
    from django.test import Client

    from idemmail_celery.contrib.django.models import OutboxRow

    address = f"twice-{uuid.uuid4().hex[:8]}@example.com"
    before = set(shop.published)
    for _ in range(2):  # a double click
        reply = Client().post("/sign-up", {"email": address})
        assert reply.status_code == 201, reply.content
    assert new_sends(shop, before) == []  # nothing published from the view: outbox rows, relayed after the commit
    rows = list(OutboxRow.objects.filter(kwargs__contains=address))
    assert len(rows) == 1  # the second post's row was the same intent
    wait_for(lambda: shop.sent(rows[0].intent_key), timeout=60)  # the nudged relay run published it
    run_relay(shop.app, shop.relay_url("default"))  # and a later run finds nothing left for it
    [delivery] = delivered_to(shop, address)
    assert delivery.subject == "Welcome to the shop"


def test_a_rolled_back_sign_up_sends_no_email(shop: Shop) -> None:
    from django.contrib.auth.models import User
    from django.test import Client

    from idemmail_celery.contrib.django.models import OutboxRow

    address = f"declined-{uuid.uuid4().hex[:8]}@example.com"
    reply = Client().post("/sign-up", {"email": address, "decline_terms": "1"})
    assert reply.status_code == 409
    assert not User.objects.filter(username=address).exists()
    assert not OutboxRow.objects.filter(kwargs__contains=address).exists()
    run_relay(shop.app, shop.relay_url("default"))
    assert delivered_to(shop, address) == []


def test_a_message_django_builds_but_the_library_refuses_raises_at_send_mail(shop: Shop) -> None:
    from django.core.mail import EmailMessage, EmailMultiAlternatives, get_connection, send_mail
    from django.test import Client

    from idemmail_celery import InvalidEmail
    from idemmail_celery.errors import IdempotencyKeyError

    before = set(shop.published)
    with pytest.raises(InvalidEmail) as refused:
        send_mail("Hi", "Hello.", None, ["ann@example.com", "bob at example.com"], fail_silently=True)
    assert refused.value.field == "to"
    invite = EmailMultiAlternatives("Invite", "See you at 10.", None, ["ann@example.com"])
    invite.attach_alternative("BEGIN:VCALENDAR\r\nEND:VCALENDAR\r\n", "text/calendar")
    with pytest.raises(InvalidEmail, match="text/calendar") as refused:
        invite.send()
    assert refused.value.field == "alternatives"
    reply = Client().post("/sign-up", {"email": "not-an-address"})
    assert (reply.status_code, reply.json()) == (400, {"error": "InvalidEmail", "field": "to"})
    batch = [EmailMessage("Fine", "Hello.", None, ["ann@example.com"]),
             EmailMessage("Forged", "Hello.", None, ["ann@example.com"], headers={"Message-ID": "<1@evil.example>"})]
    with pytest.raises(InvalidEmail) as refused:
        get_connection().send_messages(batch)  # the whole batch checked first: the fine one is not sent either
    assert refused.value.field.startswith("headers")
    batch[1] = EmailMessage("Keyed", "Hello.", None, ["ann@example.com"], headers={"Idempotency-Key": " "})
    with pytest.raises(IdempotencyKeyError, match="empty"):
        get_connection().send_messages(batch)
    assert new_sends(shop, before) == []


def test_one_backend_connection_carries_every_message_until_it_is_closed(shop: Shop) -> None:
    from django.core.mail import EmailMessage, get_connection

    address = f"reuse-{uuid.uuid4().hex[:8]}@example.com"
    before = set(shop.published)
    with get_connection() as connection:
        producer = connection._producer
        assert producer is not None and connection.open() is False  # already open: the same connection
        sent = [EmailMessage(f"Note {i}", "Hello.", None, [address], connection=connection).send() for i in (1, 2)]
        assert connection._producer is producer
    assert sent == [1, 1] and connection._producer is None
    assert sorted(o["status"] for o in results(new_sends(shop, before), timeout=90)) == ["sent", "sent"]


def test_an_idempotency_key_header_is_the_intent_and_the_same_words_a_window_later_are_another(shop: Shop) -> None:
    from django.conf import global_settings
    from django.core.mail import EmailMessage, get_connection
    from django.test import override_settings

    from idemmail_celery import ConfigurationError
    from idemmail_celery.contrib.django.mail import intent_of

    address = f"window-{uuid.uuid4().hex[:8]}@example.com"
    before = set(shop.published)
    for body in ("Your parcel left.", "Your parcel left the depot."):  # reworded, under one key: one email
        shipped = EmailMessage("Shipped", body, None, [address], headers={"Idempotency-Key": f"ship-{address}"})
        assert shipped.send() == 1
    assert "headers" not in intent_of(shipped, 600)[0]  # the key is the library's, never a header of the mail
    assert intent_of(shipped, 600)[0]["from_"] == "Shop <shop@example.com>"  # DEFAULT_FROM_EMAIL
    with override_settings(DEFAULT_FROM_EMAIL=global_settings.DEFAULT_FROM_EMAIL):  # a project that never set it
        assert "from_" not in intent_of(EmailMessage("Hi", "Hello.", None, [address]), 600)[0]  # default_from
    assert sorted(o["status"] for o in results(new_sends(shop, before), timeout=90)) == ["duplicate", "sent"]
    before = set(shop.published)
    with pytest.raises(ConfigurationError, match="window"):
        get_connection(window=0)
    connection = get_connection(window=2)
    slot_ends = (time.time() // 2 + 1) * 2
    EmailMessage("Reminder", "Your cart waits.", None, [address], connection=connection).send()
    time.sleep(max(0.0, slot_ends - time.time()) + 0.05)  # the next window: the same words are a new intent
    EmailMessage("Reminder", "Your cart waits.", None, [address], connection=connection).send()
    assert [o["status"] for o in results(new_sends(shop, before), timeout=90)] == ["sent", "sent"]
    assert [d.subject for d in delivered_to(shop, address)] == ["Shipped", "Reminder", "Reminder"]


def test_fail_silently_makes_a_broker_that_does_not_answer_a_message_not_sent(shop: Shop) -> None:
    import socket

    from django.core.mail import send_mail
    from kombu.exceptions import OperationalError

    with socket.socket() as s:  # a port nothing listens on: the broker "down"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app, url = shop.app, shop.app.conf.broker_url
    app.conf.broker_url = f"redis://127.0.0.1:{port}/0"
    app._pool, app.amqp._producer_pool = None, None  # the pools are made again from the URL on first use
    try:
        assert send_mail("Down", "Hello.", None, ["down@example.com"], fail_silently=True) == 0
        with pytest.raises(OperationalError):
            send_mail("Down", "Hello.", None, ["down@example.com"])
    finally:
        app.pool.force_close_all()
        app.conf.broker_url = url
        app._pool, app.amqp._producer_pool = None, None
    assert send_mail("Up", "Hello.", None, ["up-again@example.com"]) == 1  # the project's broker again


def test_the_backend_draws_no_deprecation_warning_from_the_running_django(shop: Shop) -> None:
    """Django 6.1 names backends in MAILERS and deprecates a backend that passes ``fail_silently`` up:
    the project's own settings (MAILERS there, EMAIL_BACKEND before 6.1) and every way of sending warn
    of nothing about this backend."""
    import warnings

    import django
    from django.conf import settings
    from django.core.mail import EmailMessage, get_connection, send_mail

    from idemmail_celery.contrib.django import EmailBackend

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert send_mail("Quiet", "Hello.", None, ["quiet@example.com"], fail_silently=True) == 1
        connection = get_connection()
        assert isinstance(connection, EmailBackend)
        with connection:
            assert EmailMessage("Quiet too", "Hello.", to=["quiet@example.com"], connection=connection).send() == 1
    ours = [str(w.message) for w in caught if "idemmail" in str(w.message) or "idemmail" in w.filename
            or "EMAIL_BACKEND" in str(w.message)]
    assert ours == []
    if django.VERSION >= (6, 1):
        assert settings.MAILERS["default"]["BACKEND"] == "idemmail_celery.contrib.django.EmailBackend"
