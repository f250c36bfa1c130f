"""Settings given as strings (environment variables, config files) are parsed strictly, never by truthiness."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from cryptography.fernet import Fernet

from idemmail_celery import ConfigurationError, IdempotentTask
from idemmail_celery import ledger as ledger_mod
from idemmail_celery.config import Settings
from idemmail_celery.ledger.sql import SQLLedger

BOOLS = [("idemmail_fail_open", "fail_open"), ("idemmail_keep_payload", "keep_payload"),
         ("idemmail_carries_key", "carries_key"), ("idemmail_redact_args", "redact_args")]


@pytest.mark.parametrize(("setting", "attr"), BOOLS)
@pytest.mark.parametrize(("given", "meant"), [
    ("false", False), ("False", False), (" FALSE ", False), ("0", False), ("no", False), ("off", False),
    ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("On", True),
    (True, True), (False, False), (1, True), (0, False), ("", False),  # empty: not set, the default
])
def test_boolean_settings_given_as_strings_mean_what_they_say(setting: str, attr: str, given: Any, meant: bool) -> None:
    s = Settings.resolve({setting: given}, None)
    if given == "":
        meant = getattr(Settings(), attr)  # not set: the default (redact_args defaults to True)
    assert getattr(s, attr) is meant


@pytest.mark.parametrize(("setting", "attr"), BOOLS)
@pytest.mark.parametrize("given", ["nope", "enabled", "2", 2, -1, 0.5, [], {}, "sk_live_do_not_echo"])
def test_a_boolean_setting_that_is_no_boolean_is_refused_by_name_without_echoing_it(
    setting: str, attr: str, given: Any
) -> None:
    with pytest.raises(ConfigurationError, match=setting) as err:
        Settings.resolve({setting: given}, None)
    assert "sk_live" not in str(err.value)


def test_number_settings_given_as_strings_are_numbers() -> None:
    s = Settings.resolve({
        "idemmail_outage_max_retries": "5", "idemmail_max_reclaims": " 2 ", "idemmail_inflight_max_retries": 7.0,
        "idemmail_lease_seconds": "45.5", "idemmail_retention_seconds": "3600", "idemmail_retry_backoff": "0.5",
        "idemmail_inflight_backoff_max": b"10",
    }, None)
    assert s.outage_max_retries == 5 and type(s.outage_max_retries) is int
    assert (s.max_reclaims, s.inflight_max_retries) == (2, 7) and type(s.inflight_max_retries) is int
    assert (s.lease_seconds, s.retention_seconds, s.retry_backoff, s.inflight_backoff_max) == (45.5, 3600.0, 0.5, 10.0)
    assert Settings.resolve({"idemmail_outage_max_retries": ""}, None).outage_max_retries is None  # unset


@pytest.mark.parametrize(("setting", "given"), [
    ("idemmail_outage_max_retries", "five"), ("idemmail_outage_max_retries", "2.5"),
    ("idemmail_outage_max_retries", True), ("idemmail_max_reclaims", 1.5), ("idemmail_max_reclaims", "-"),
    ("idemmail_lease_seconds", "soon"), ("idemmail_lease_seconds", "nan"), ("idemmail_retry_backoff", "inf"),
    ("idemmail_retention_seconds", []), ("idemmail_inflight_backoff", True),
])
def test_a_number_setting_that_is_no_number_is_refused_by_name(setting: str, given: Any) -> None:
    with pytest.raises(ConfigurationError, match=setting):
        Settings.resolve({setting: given}, None)


def test_negative_outage_budget_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="outage_max_retries"):
        Settings.resolve({"idemmail_outage_max_retries": "-1"}, None)


def test_task_options_are_parsed_and_named_too() -> None:
    class Opts:
        idempotency_fail_open = "false"
        idempotency_carries_key = "yes"
        idempotency_lease_seconds = "60"
        idempotency_redact_args = "maybe"

    with pytest.raises(ConfigurationError, match="idempotency_redact_args"):
        Settings.resolve({}, Opts())
    Opts.idempotency_redact_args = "off"
    s = Settings.resolve({"idemmail_fail_open": True, "idemmail_redact_args": True}, Opts())
    assert (s.fail_open, s.carries_key, s.redact_args, s.lease_seconds) == (False, True, False, 60.0)


def test_a_tasks_retry_deadline_overrides_the_apps_and_reaches_its_policy() -> None:
    from celery import Celery

    from idemmail_celery import IdempotentTask

    app = Celery("deadline", set_as_current=False)
    app.conf.update(idemmail_retry_deadline_seconds="7200", idemmail_ledger_url="sqlite:///:memory:")

    @app.task(shared=False, base=IdempotentTask, idempotency_retry_deadline_seconds="900")
    def reset(to: str) -> None: ...

    @app.task(shared=False, base=IdempotentTask)
    def receipt(to: str) -> None: ...

    assert reset.policy.retry_deadline_seconds == 900.0 and receipt.policy.retry_deadline_seconds == 7200.0
    assert Settings.resolve({}, None).retry_deadline_seconds == 6 * 3600.0
    with pytest.raises(ConfigurationError, match="idemmail_retry_deadline_seconds must be > 0"):
        Settings.resolve({"idemmail_retry_deadline_seconds": "0"}, None)


def test_settings_built_directly_are_parsed_by_field_name() -> None:
    assert Settings(fail_open="off", lease_seconds="30").fail_open is False  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="keep_payload"):
        Settings(keep_payload="nah")  # type: ignore[arg-type]


def test_ledger_kwargs_hand_the_backend_real_booleans_and_numbers() -> None:
    s = Settings.resolve({
        "idemmail_keep_payload": "0",
        "idemmail_ledger_options": {"allow_eviction": "false", "auto_init": "no", "buckets": "16",
                                    "create_table": "1", "prefix": "shop", "retention_seconds": "60"},
    }, None)
    kw = s.ledger_kwargs()
    assert kw["keep_payload"] is False and kw["allow_eviction"] is False and kw["auto_init"] is False
    assert kw["create_table"] is True and kw["buckets"] == 16 and kw["retention_seconds"] == 60.0
    assert kw["prefix"] == "shop"  # any other backend keyword passes as given
    led = SQLLedger("sqlite://", **Settings.resolve({"idemmail_keep_payload": "false"}, None).ledger_kwargs())
    assert led.keep_payload is False
    with pytest.raises(ConfigurationError, match=r"idemmail_ledger_options\['allow_eviction'\]"):
        Settings.resolve({"idemmail_ledger_options": {"allow_eviction": "please"}}, None)
    with pytest.raises(ConfigurationError, match="idemmail_ledger_options must be a mapping"):
        Settings.resolve({"idemmail_ledger_options": "prefix=shop"}, None)


def test_redact_args_setting_given_as_false_string_does_not_redact_and_true_string_does() -> None:
    app = Celery("redact", set_as_current=False)
    app.conf.update(idemmail_ledger_url="sqlite://", idemmail_key_secret="s", task_always_eager=False)
    sent: list[dict[str, Any]] = []

    @app.task(base=IdempotentTask, bind=True, shared=False, name="redact.t")
    def t(self: Any, to: str) -> None: ...

    def capture(self: Any, *args: Any, **options: Any) -> None:
        sent.append(options)

    import celery.app.task

    original = celery.app.task.Task.apply_async
    celery.app.task.Task.apply_async = capture  # type: ignore[method-assign]
    try:
        app.conf.idemmail_redact_args = "false"
        t.delay("ann@example.com")
        assert "argsrepr" not in sent[-1]
        t._idem_settings = None
        app.conf.idemmail_redact_args = "true"
        t.delay("ann@example.com")
        assert sent[-1]["argsrepr"] == "<redacted>"
        t._idem_settings = None
        app.conf.idemmail_redact_args = "sometimes"
        with pytest.raises(ConfigurationError, match="idemmail_redact_args"):
            t.delay("ann@example.com")
    finally:
        celery.app.task.Task.apply_async = original  # type: ignore[method-assign]


def test_ledger_cache_key_holds_a_digest_not_the_payload_keys() -> None:
    secret = Fernet.generate_key().decode()
    before = set(ledger_mod._shared)
    try:
        led = ledger_mod.shared("sqlite://", {"payload_keys": [secret], "retention_seconds": 60.0})
        assert ledger_mod.shared("sqlite://", {"retention_seconds": 60.0, "payload_keys": [secret]}) is led
        assert ledger_mod.shared("sqlite://", {"retention_seconds": 61.0, "payload_keys": [secret]}) is not led
        new = set(ledger_mod._shared) - before
        assert len(new) == 2 and all(secret not in repr(k) for k in new)
    finally:
        for k in set(ledger_mod._shared) - before:
            ledger_mod._shared.pop(k).close()


def test_a_misspelt_setting_is_refused_at_delay_naming_the_one_it_meant() -> None:
    """``idemmail_payload_keys`` misspelt would store payloads in the clear: never silently ignored."""
    app = Celery("typo", broker="memory://", set_as_current=False)
    app.conf.update(idemmail_ledger_url="sqlite://", idemmail_key_secret="s", idemmail_payload_kyes=["k"])

    @app.task(base=IdempotentTask, name="typo.t", shared=False)
    def t(to: str) -> None: ...

    with pytest.raises(ConfigurationError, match=r"idemmail_payload_kyes \(did you mean idemmail_payload_keys\?\)"):
        t.delay("ann@example.com")
    app.conf.idemmail_payload_kyes = None
    del app.conf["idemmail_payload_kyes"]
    assert Settings.resolve(app.conf).ledger_url == "sqlite://"  # known settings only: resolved


def test_the_key_secret_environment_variable_rotates_with_a_json_array(monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery("env-rotation", set_as_current=False)
    monkeypatch.setenv("IDEMMAIL_KEY_SECRET", '["new-secret", "old-secret"]')
    assert Settings.resolve(app.conf).key_secrets == (b"new-secret", b"old-secret")
    monkeypatch.setenv("IDEMMAIL_KEY_SECRET", "one, with a comma")  # one secret: never split
    assert Settings.resolve(app.conf).key_secrets == (b"one, with a comma",)
    monkeypatch.setenv("IDEMMAIL_KEY_SECRET", '["unclosed"')
    with pytest.raises(ConfigurationError, match="IDEMMAIL_KEY_SECRET: starts with"):
        Settings.resolve(app.conf)
    monkeypatch.setenv("IDEMMAIL_KEY_SECRET", "")
    app.conf.idemmail_key_secret = '["looks", "like json"]'  # app.conf takes a real list: this is one secret
    assert Settings.resolve(app.conf).key_secrets == (b'["looks", "like json"]',)


def test_upper_case_names_in_the_conf_are_a_projects_own_and_left_alone() -> None:
    """A Django project's settings reach Celery's conf (config_from_object with a namespace): its own
    IDEMMAIL_KEY_SECRET variable is not a misspelt setting."""
    app = Celery("django-like", set_as_current=False)
    app.conf.update(IDEMMAIL_KEY_SECRET="from-the-project", idemmail_ledger_url="sqlite://")
    assert Settings.resolve(app.conf).ledger_url == "sqlite://"
