"""Redis over TLS (rediss://), as ElastiCache and Memorystore with in-transit encryption: a CA and
a server certificate for `localhost` made by the test, verification on. The state store, round
log and job logs work with FEDHIVE_REDIS_CA_FILE naming the CA; another CA, the system trust
store, or a host name the certificate does not name are refused in one line, not retried."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import structlog

from fedhive.config import Settings
from fedhive.errors import ConfigError
from fedhive.joblogs.lines import Line
from fedhive.joblogs.wire import CLIENT_JOB
from fedhive.jobs.status import JobStatus
from fedhive.state import RedisStateStore
from fedhive.state.joblogs import JobLogStore
from fedhive.state.rounds import RoundLog
from tests.fixtures.certs import CertAuthority
from tests.fixtures.redis_servers import TlsRedis
from tests.fixtures.state import submit_in


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("redis-tls")


@pytest.fixture(scope="module")
def ca(tls_dir: Path) -> CertAuthority:
    return CertAuthority.create(tls_dir / "ca")


@pytest.fixture(scope="module")
def tls_redis(tls_dir: Path, ca: CertAuthority) -> Iterator[TlsRedis]:
    cert = ca.issue("redis", dns=("localhost",))  # not 127.0.0.1: the host name is checked
    with TlsRedis(tls_dir / "server", cert, ca.pem) as server:
        yield server


@pytest.fixture
def tls_settings(tls_redis: TlsRedis, ca: CertAuthority, namespace: str) -> Settings:
    """The module's Redis is its own and goes with it: its keys need no deleting."""
    return Settings(redis_url=tls_redis.url, redis_ca_file=str(ca.pem), namespace=namespace)


def test_the_state_store_round_log_and_job_logs_work_over_tls(tls_settings: Settings) -> None:
    store = RedisStateStore.from_settings(tls_settings)
    rounds = RoundLog.from_settings(tls_settings)
    logs = JobLogStore.from_settings(tls_settings)
    try:
        submit_in(store, "j1", JobStatus.RUNNING)
        assert store.get_job("j1").status is JobStatus.RUNNING
        assert store.acquire("scheduler", "a", 10) == 1
        rounds.append("j1", {"round": 0})
        assert rounds.read("j1") == [{"round": 0}]
        assert logs.append("j1", "site-1", CLIENT_JOB, 0, [Line(4, "hello", False)]) == 1
        assert [entry.line for entry in logs.read("j1").lines] == ["hello"]
    finally:
        for closing in (store, rounds, logs):
            closing.close()


@pytest.mark.parametrize("trust", ["another CA", "the system trust store", "a wrong host"])
def test_a_certificate_not_accepted_is_one_line_and_not_retried(
    trust: str, tls_settings: Settings, tls_redis: TlsRedis, tmp_path: Path,
) -> None:
    if trust == "another CA":
        settings = replace(tls_settings,
                           redis_ca_file=str(CertAuthority.create(tmp_path, "other CA").pem))
        problem, host = "self-signed certificate in certificate chain", "localhost"
    elif trust == "the system trust store":
        settings = replace(tls_settings, redis_ca_file=None)
        problem, host = "self-signed certificate in certificate chain", "localhost"
    else:
        settings = replace(tls_settings, redis_url=f"rediss://127.0.0.1:{tls_redis.port}/0")
        problem, host = "IP address mismatch", "127.0.0.1"
    store = RedisStateStore.from_settings(settings)
    try:
        with structlog.testing.capture_logs() as logged, \
                pytest.raises(ConfigError) as raised:
            store.get_job("j1")
    finally:
        store.close()
    message = str(raised.value)
    assert message.startswith(f"redis at {host}:{tls_redis.port} refused over TLS: "
                              f"certificate verify failed: {problem}")
    assert "FEDHIVE_REDIS_CA_FILE" in message and "\n" not in message
    assert raised.value.field == "FEDHIVE_REDIS_CA_FILE"
    assert [entry for entry in logged if entry["event"] == "redis_retry"] == []
