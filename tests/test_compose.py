"""compose.yaml refers only to things that exist: no Docker engine here, so every reference is checked by hand.

Commands: the ``-A`` app of each ``celery`` command imports and is a Celery app, the subcommand
and every option exist, the beat scheduler imports; ``flask --app`` names a Flask app;
``python -m`` modules run (the mail catcher is started and sent an email). Environment: every
``IDEMMAIL_*`` variable is a setting the package reads and lands in ``app.conf``; every other
variable is read by the package, the examples or the library named for it. URLs point at
services on the ports they listen on; host ports are bound to loopback and do not collide;
Flower's API asks for a password; ``depends_on`` names exist; the build context, the Dockerfile
and what it copies and installs exist.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml
from celery import Celery, current_app
from celery.app.utils import find_app
from flask import Flask
from kombu.utils.imports import symbol_by_name

from .conftest import pyproject

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
BUILT = [name for name, s in SERVICES.items() if "build" in s]
PACKAGE_SOURCES = "\n".join(p.read_text() for p in (ROOT / "idemmail_celery").rglob("*.py"))
#: Where the images we do not build document their variables.
IMAGE_ENV = {"postgres": {"POSTGRES_PASSWORD", "POSTGRES_DB"}}
#: Ports the images we do not build listen on.
IMAGE_PORTS = {"redis": 6379, "postgres": 5432}


def settings_the_package_reads() -> set[str]:
    from idemmail_celery.config import SETTINGS

    return {s.conf for s in SETTINGS}


def celery_commands() -> Iterator[tuple[str, list[str]]]:
    for name, service in SERVICES.items():
        command = service.get("command") or []
        if command[:1] == ["celery"]:
            yield name, command


def option_names(params: list[click.Parameter]) -> set[str]:
    return {opt for p in params for opt in [*p.opts, *p.secondary_opts]}


def options_in(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("-")]


def listening_port(name: str) -> int:
    command = SERVICES[name].get("command") or []
    for i, arg in enumerate(command):
        if arg == "--port":
            return int(command[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    return IMAGE_PORTS[name]


@pytest.fixture
def compose_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The web service's environment, with the database on a local SQLite file (no PostgreSQL host here)."""
    env = {k: str(v) for k, v in SERVICES["web"]["environment"].items()}
    for name, value in {**env, "SHOP_DATABASE_URL": f"sqlite:///{tmp_path / 'shop.sqlite3'}"}.items():
        monkeypatch.setenv(name, value)
    sys.modules.pop("examples.flask_shop", None)
    previous = current_app._get_current_object()
    yield env
    previous.set_current()  # the example's app points at hosts named redis and postgres: not for later tests
    sys.modules.pop("examples.flask_shop", None)


def test_services_are_images_or_built_from_files_that_exist() -> None:
    assert set(SERVICES) >= {"redis", "postgres", "worker", "beat", "flower", "web", "mailcatcher"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    for name, service in SERVICES.items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            assert (ROOT / service["build"] / "Dockerfile").is_file(), name
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), path
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', dockerfile)
    assert extras, dockerfile
    declared = pyproject()["project"]["optional-dependencies"]
    assert set(extras.group(1).split(",")) <= set(declared)
    pinned = {line.split("==")[0].lower() for line in (ROOT / "constraints.txt").read_text().splitlines()}
    for extra_package in re.search(r'\]" (.+)$', dockerfile, re.MULTILINE).group(1).split():  # type: ignore[union-attr]
        assert extra_package.lower() in pinned, extra_package


def test_redis_keeps_the_ledger_append_only_and_never_evicts() -> None:
    command = " ".join(SERVICES["redis"]["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command


def test_celery_commands_name_an_app_a_subcommand_and_options_that_exist(compose_env: dict[str, str]) -> None:
    from celery.bin.celery import celery as celery_cli
    from flower.options import options as flower_options

    commands = dict(celery_commands())
    assert set(commands) == {"worker", "beat", "flower"}
    for name, command in commands.items():
        app_spec = command[command.index("-A") + 1]
        assert isinstance(find_app(app_spec), Celery), (name, app_spec)
        sub = command[command.index("-A") + 2]
        assert sub in celery_cli.commands, (name, sub)
        args = command[command.index("-A") + 3:]
        if sub == "flower":  # Flower's options are tornado options
            known = {f"--{o}" for o in flower_options._options} | {f"--{o.replace('-', '_')}"
                                                                   for o in flower_options._options}
        else:
            known = option_names(celery_cli.commands[sub].params)
        assert set(options_in(args)) <= known, (name, set(options_in(args)) - known)
        for arg in args:
            if arg.startswith("--scheduler="):
                symbol_by_name(arg.split("=", 1)[1])
    app = find_app(commands["beat"][commands["beat"].index("-A") + 1])
    assert "idemmail_celery.outbox_relay" in app.tasks
    assert {e["task"] for e in app.conf.beat_schedule.values()} <= set(app.tasks)


def test_web_command_names_a_flask_app_and_run_options_that_exist(compose_env: dict[str, str]) -> None:
    import flask.cli

    command = SERVICES["web"]["command"]
    assert command[:2] == ["flask", "--app"] and command[3] == "run"
    module, _, attr = command[2].partition(":")
    assert isinstance(getattr(importlib.import_module(module), attr), Flask)
    assert set(options_in(command[4:])) <= option_names(flask.cli.run_command.params)


@pytest.mark.parametrize("missing", ["INBOUND_WEBHOOK_SECRET", "PAYMENT_WEBHOOK_SECRET"])
def test_the_shop_refuses_to_start_without_its_secrets_unless_in_dev_mode(
        compose_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    assert "SHOP_DEV" not in compose_env  # the stack sets real (local) secrets, not dev mode
    monkeypatch.delenv(missing)
    monkeypatch.delenv("SHOP_DEV", raising=False)
    with pytest.raises(RuntimeError, match=missing):
        importlib.import_module("examples.flask_shop")
    sys.modules.pop("examples.flask_shop", None)
    monkeypatch.setenv("SHOP_DEV", "1")
    with pytest.warns(UserWarning, match=f"{missing} is the dev-only value"):
        shop = importlib.import_module("examples.flask_shop")
    assert "dev-only" in (shop.WEBHOOK_SECRET if missing.startswith("INBOUND") else shop.PAYMENT_SECRET)


def test_every_idemmail_variable_is_a_real_setting_and_reaches_app_conf(compose_env: dict[str, str]) -> None:
    known = settings_the_package_reads()
    assert {"idemmail_ledger_url", "idemmail_provider_url", "idemmail_metrics_port"} <= known  # the scan works
    app = importlib.import_module("examples.flask_shop").celery
    for name, service in SERVICES.items():
        for var, value in (service.get("environment") or {}).items():
            if var.startswith("IDEMMAIL_"):
                assert var.lower() in known, (name, var)
                if var in compose_env:
                    assert str(app.conf[var.lower()]) == str(value), var
    assert app.conf.broker_url == compose_env["CELERY_BROKER_URL"]
    assert app.conf.result_backend == compose_env["CELERY_RESULT_BACKEND"]


def test_every_other_variable_is_read_by_what_the_service_runs() -> None:
    site = Path(click.__file__).resolve().parent.parent
    readers = {"CELERY_": site / "celery" / "app" / "utils.py", "FLOWER_": site / "flower" / "api" / "__init__.py",
               "PROMETHEUS_": site / "prometheus_client" / "multiprocess.py"}
    examples = "\n".join(p.read_text() for p in (ROOT / "examples").glob("*.py"))
    for name, service in SERVICES.items():
        for var in service.get("environment") or {}:
            if var.startswith("IDEMMAIL_"):
                continue
            if name in IMAGE_ENV:
                assert var in IMAGE_ENV[name], (name, var)
                continue
            reader = next((path for prefix, path in readers.items() if var.startswith(prefix)), None)
            text = reader.read_text() if reader else examples + PACKAGE_SOURCES
            assert var in text, (name, var)


def test_urls_point_at_services_on_the_ports_they_listen_on() -> None:
    urls = 0
    for name, service in SERVICES.items():
        for var, value in (service.get("environment") or {}).items():
            parts = urlsplit(str(value))
            if parts.scheme and parts.hostname in SERVICES:
                urls += 1
                assert parts.port == listening_port(parts.hostname), (name, var, value)
                assert parts.hostname in (service.get("depends_on") or {}), (name, var)
    assert urls >= 6


def test_ports_are_loopback_only_do_not_collide_and_dependencies_exist() -> None:
    host_ports: list[str] = []
    for name, service in SERVICES.items():
        for mapping in service.get("ports") or []:
            address, host, container = str(mapping).split(":")  # "8025:8025" would listen on every interface
            assert address == "127.0.0.1", (name, mapping)
            host_ports.append(host)
            if name != "worker":
                assert int(container) == listening_port(name), (name, mapping)
        for dependency in service.get("depends_on") or {}:
            assert dependency in SERVICES and dependency != name, (name, dependency)
    assert len(host_ports) == len(set(host_ports)), host_ports
    worker = SERVICES["worker"]
    assert f":{worker['environment']['IDEMMAIL_METRICS_PORT']}:" in " ".join(worker["ports"])
    assert host_ports, "no published ports: the README's URLs would not answer"
    for volume in [v.split(":")[0] for s in SERVICES.values() for v in s.get("volumes") or []]:
        assert volume in COMPOSE["volumes"], volume


def test_flower_api_needs_a_password() -> None:
    """Flower's API applies any task by name (send_email included): open, anyone who reaches it sends mail."""
    flower = SERVICES["flower"]
    assert "FLOWER_UNAUTHENTICATED_API" not in (flower.get("environment") or {})
    assert "FLOWER_UNAUTHENTICATED_API" not in (SERVICES["web"].get("environment") or {})  # the shared block
    credentials = [a.split("=", 1)[1] for a in flower["command"] if a.startswith(("--basic-auth=", "--auth="))]
    assert credentials and all(c.strip() for c in credentials), flower["command"]


def test_mail_catcher_command_runs_and_shows_what_it_accepted() -> None:
    command = SERVICES["mailcatcher"]["command"]
    assert command[:3] == ["python", "-m", "idemmail_celery.testing"]
    args = list(command[3:])
    args[args.index("--host") + 1], args[args.index("--port") + 1] = "127.0.0.1", "0"  # loopback, a free port
    api_key = args[args.index("--api-key") + 1]
    assert api_key == SERVICES["worker"]["environment"]["IDEMMAIL_PROVIDER_API_KEY"]
    proc = subprocess.Popen([sys.executable, "-m", "idemmail_celery.testing", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", proc.stdout.readline()).group(1))  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        body = json.dumps({"from": "shop@example.com", "to": "ann@example.com", "subject": "Hi", "text": "x"})
        request = urllib.request.Request(f"{base}/emails", data=body.encode(), method="POST", headers={
            "Authorization": f"Bearer {api_key}", "Content-Type": "application/json", "Idempotency-Key": "k1"})
        for _ in range(2):
            with urllib.request.urlopen(request, timeout=5) as reply:
                assert reply.status == 200
        with urllib.request.urlopen(f"{base}/_fake/deliveries", timeout=5) as reply:
            deliveries = json.loads(reply.read())
        # --no-dedupe: the catcher shows every request it accepted, even under one key
        assert [(d["to"], d["subject"], d["key"]) for d in deliveries] == [(["ann@example.com"], "Hi", "k1")] * 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode == 0  # SIGTERM is a clean stop
