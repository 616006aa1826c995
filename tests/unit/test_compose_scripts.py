"""deploy/compose/'s scripts run for real against local stand-ins: broker_setup.py against a
fake RabbitMQ management API and admins_file.py (healthcheck.py: tests/unit/test_readiness.py)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import os
import pwd
import socket
import threading
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pika
import pytest

from fedhive.auth import AdminDirectory, Role
from fedhive.brokerusers import definitions, service_permissions, site_permissions
from fedhive_services.site_agent.config import load_site, load_site_resources

from .deploy_scripts import admins_file, broker_setup

STORAGE = "http://minio:9000/fedhive"


class ManagementApi:
    """Stands in for RabbitMQ's management API: records what POST /api/definitions gets."""

    def __init__(self, user: str, password: str, status: int = 204) -> None:
        self.posts: list[tuple[str, dict[str, Any]]] = []
        auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                api.posts.append((self.path, body))
                ok = self.headers.get("authorization") == auth
                self.send_response(status if ok else 401)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def management() -> Iterator[ManagementApi]:
    api = ManagementApi("admin", "admin-pw")
    yield api
    api.close()


@pytest.fixture
def setup_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("FEDHIVE_", "AWS_", "RABBITMQ_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("FEDHIVE_AMQP_URL", "amqp://rabbitmq:5672/%2F")
    monkeypatch.setenv("FEDHIVE_NAMESPACE", "fh")
    monkeypatch.setenv("RABBITMQ_USER", "admin")
    monkeypatch.setenv("RABBITMQ_PASSWORD", "admin-pw")
    monkeypatch.setenv("RABBITMQ_SERVICES_PASSWORD", "services-pw")


def _setup(management: ManagementApi, root: Path) -> int:
    me = pwd.getpwuid(os.getuid()).pw_name
    code: int = broker_setup.main(["site-a", "site-b", "--management-url", management.url,
                                   "--sites-root", str(root), "--owner", me, "--wait", "2",
                                   "--storage-url", STORAGE])
    return code


@pytest.mark.usefixtures("setup_env")
def test_broker_setup_creates_the_users_and_writes_each_site_folder(
        management: ManagementApi, tmp_path: Path) -> None:
    assert _setup(management, tmp_path) == 0
    [(path, document)] = management.posts
    assert path == "/api/definitions"
    assert [user["name"] for user in document["users"]] == ["fedhive-services", "fh.site-a",
                                                            "fh.site-b"]
    expected = definitions([], "/", "fh")
    assert (document["vhosts"], document["exchanges"]) == (expected["vhosts"],
                                                           expected["exchanges"])
    assert {x["name"] for x in document["exchanges"]} == {"fh.cmd", "fh.events", "fh.dlx",
                                                          "fh.replies"}
    permissions = {p["user"]: (p["configure"], p["write"], p["read"])
                   for p in document["permissions"]}
    for user, wanted in (("fedhive-services", service_permissions("fh")),
                         ("fh.site-a", site_permissions("fh", "site-a"))):
        assert permissions[user] == (wanted.configure, wanted.write, wanted.read)
    assert len(document["topic_permissions"]) == 6  # three exchanges per site
    # a site's user configures nothing: the same import declares and binds its control queue
    assert [(q["name"], q["arguments"]) for q in document["queues"]] == [
        (f"fh.site.{site}", {"x-queue-type": "quorum", "x-delivery-limit": 5})
        for site in ("site-a", "site-b")]
    assert [(b["source"], b["destination"], b["routing_key"]) for b in document["bindings"]] == [
        ("fh.cmd", f"fh.site.{site}", f"fh.site.{site}") for site in ("site-a", "site-b")]
    for site in ("site-a", "site-b"):
        config = load_site(tmp_path / site)
        load_site_resources(config)
        params = pika.URLParameters(config.broker_url)
        assert (config.site, config.namespace, params.host, params.port) == (site, "fh",
                                                                            "rabbitmq", 5672)
        assert params.credentials.username == f"fh.{site}"
        assert (config.services_user, config.storage_url) == ("fedhive-services", STORAGE)
        assert ((tmp_path / site / "local" / "site.json").stat().st_mode & 0o777) == 0o600


@pytest.mark.usefixtures("setup_env")
def test_broker_setup_again_keeps_passwords_and_operator_fields(
        management: ManagementApi, tmp_path: Path) -> None:
    assert _setup(management, tmp_path) == 0
    site_file = tmp_path / "site-a" / "local" / "site.json"
    edited = {**json.loads(site_file.read_text()), "heartbeat_interval_s": 2, "org": "Org A"}
    site_file.write_text(json.dumps(edited))
    assert _setup(management, tmp_path) == 0
    assert json.loads(site_file.read_text()) == edited  # the same broker URL, fields kept
    password = pika.URLParameters(edited["broker_url"]).credentials.password
    for _, document in management.posts:  # the broker got that password both times
        [user] = [user for user in document["users"] if user["name"] == "fh.site-a"]
        salted = base64.b64decode(user["password_hash"])
        assert salted[4:] == hashlib.sha256(salted[:4] + password.encode()).digest()


@pytest.mark.usefixtures("setup_env")
def test_broker_setup_refuses_a_wrong_admin_and_an_unsafe_password(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    with closing(ManagementApi("admin", "other")) as wrong:
        assert _setup(wrong, tmp_path) == 2
    assert "refused RABBITMQ_USER 'admin' (HTTP 401)" in capsys.readouterr().err
    assert not (tmp_path / "site-a").exists()
    monkeypatch.setenv("RABBITMQ_SERVICES_PASSWORD", "a@b")
    with closing(ManagementApi("admin", "admin-pw")) as right:
        assert _setup(right, tmp_path) == 2
    assert "RABBITMQ_SERVICES_PASSWORD must be URL-safe" in capsys.readouterr().err
    assert right.posts == []
    monkeypatch.setenv("RABBITMQ_SERVICES_PASSWORD", "services-pw")
    assert broker_setup.main(["server", "--management-url", "http://127.0.0.1:1",
                              "--sites-root", str(tmp_path), "--storage-url", STORAGE]) == 2
    assert "site 'server': 'server' is reserved" in capsys.readouterr().err


@pytest.mark.usefixtures("setup_env")
def test_broker_setup_gives_up_when_the_management_api_never_answers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = broker_setup.main(["site-a", "--management-url", f"http://127.0.0.1:{unused_port()}",
                              "--sites-root", str(tmp_path), "--wait", "1",
                              "--storage-url", STORAGE])
    assert code == 2
    assert "did not answer within 1 s" in capsys.readouterr().err


def test_the_admins_file_lets_in_exactly_the_token(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    token = "fh_" + "t" * 43
    out = tmp_path / "etc" / "admins.json"
    monkeypatch.setenv("FEDHIVE_TOKEN", token)
    assert admins_file.main([str(out), "--name", "admin@x", "--org", "x"]) == 0
    admin = AdminDirectory.load(out).authenticate(token)
    assert (admin.name, admin.org, admin.role) == ("admin@x", "x", Role.PROJECT_ADMIN)
    assert token not in out.read_text() and out.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("FEDHIVE_TOKEN", "short")
    assert admins_file.main([str(out), "--name", "admin@x", "--org", "x"]) == 2


def unused_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
