"""The Redis that fedhive starts (`fedhive poc start`, `make demo`) keeps every job record when it
is killed or stopped and started again; a Redis already running that keeps nothing on disk is
named in one warning line. Each test runs a private redis-server on a free port with its folder
under tmp_path, never the shared one."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import redis

from fedhive.config import Settings
from fedhive.poc import infra
from fedhive.poc.s3server import free_ports
from tests.fixtures.infra import stop_process, wait_for

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt-get install redis-server)")


def _read(url: str, key: str) -> object:
    client = redis.Redis.from_url(url)
    try:
        return client.get(key)
    finally:
        client.close()


def test_a_redis_fedhive_starts_keeps_its_records_when_killed_or_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, amqp_url: str) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # its data folder: ~/.fedhive/redis/PORT
    port = free_ports(1)[0]
    settings = Settings(amqp_url=amqp_url, redis_url=f"redis://127.0.0.1:{port}/0")
    said: list[str] = []
    try:
        started: list[str] = []
        infra.ensure(settings, said.append, started)
        assert started == ["redis"] and said == [f"starting Redis on 127.0.0.1:{port}"]
        client = redis.Redis.from_url(settings.redis_url)
        client.set("fh:job:1", "RUNNING")
        pid = int(client.info("server")["process_id"])
        client.close()

        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not infra.answers("127.0.0.1", port), what="the killed Redis to go")
        infra.ensure(settings, said.append, [])
        assert _read(settings.redis_url, "fh:job:1") == b"RUNNING"

        infra.stop(["redis"], settings)  # `poc stop --infra`
        assert not infra.answers("127.0.0.1", port)
        infra.ensure(settings, said.append, [])
        assert _read(settings.redis_url, "fh:job:1") == b"RUNNING"
        assert said == [f"starting Redis on 127.0.0.1:{port}"] * 3  # and no warning
        data = tmp_path / ".fedhive" / "redis" / str(port)
        assert (data / "appendonlydir").is_dir() and (data / "redis.log").is_file()
        assert data.stat().st_mode & 0o777 == 0o700
    finally:
        infra.stop(["redis"], settings)


def test_a_running_redis_that_keeps_nothing_on_disk_is_named_not_changed(
        tmp_path: Path, amqp_url: str) -> None:
    port = free_ports(1)[0]
    url = f"redis://127.0.0.1:{port}/0"
    proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir",
                             str(tmp_path), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: infra.answers("127.0.0.1", port), what="the private Redis")
        settings = Settings(amqp_url=amqp_url, redis_url=url)
        said: list[str] = []
        started: list[str] = []
        infra.ensure(settings, said.append, started)
        assert started == [] and said == [
            f"warning: the Redis at 127.0.0.1:{port} (FEDHIVE_REDIS_URL) keeps nothing on disk "
            "(appendonly no, no save schedule): a Redis restart would lose every job record; "
            "turn its AOF on (redis-cli CONFIG SET appendonly yes, and `appendonly yes`, "
            "`appendfsync everysec` in its redis.conf)"]
        client = redis.Redis.from_url(url, decode_responses=True)
        assert client.config_get("appendonly") == {"appendonly": "no"}  # left as it was
        client.config_set("save", "3600 1")  # RDB snapshots: it keeps something
        assert infra.persistence_warning(url) is None
        client.config_set("save", "")
        client.config_set("appendonly", "yes")
        assert infra.persistence_warning(url) is None
        client.config_set("appendonly", "no")
        client.config_set("requirepass", "secret")  # CONFIG refused: it cannot tell, so quiet
        client.close()
        assert infra.persistence_warning(url) is None
    finally:
        stop_process(proc)
