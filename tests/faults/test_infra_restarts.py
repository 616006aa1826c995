"""The infrastructure fails under a running system: a RabbitMQ restart longer than a site's
heartbeat timeout, a Redis SIGKILL and restart from its append-only file. Both on a PRIVATE
broker node and Redis this module starts (tests/fixtures/private_infra.py), never the shared
ones; S3 is the session's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.faults.harness import Faults, fault_system
from tests.faults.scenarios import restart_broker, restart_redis
from tests.fixtures.infra import RUN_ID, S3Server, settings_for
from tests.fixtures.private_infra import PrivateBroker, PrivateRedis


@dataclass
class Private:
    faults: Faults
    broker: PrivateBroker
    redis: PrivateRedis


@pytest.fixture(scope="module")
def private(s3_server: S3Server, test_bucket: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Private]:
    tmp = tmp_path_factory.mktemp("private")
    with PrivateBroker(tmp / "rabbitmq") as broker, PrivateRedis(tmp / "redis") as redis:
        settings = settings_for(broker.amqp_url, redis.url, s3_server, test_bucket,
                                f"t{RUN_ID}-private")
        with fault_system(settings, tmp / "system", [f"p{RUN_ID}-a", f"p{RUN_ID}-b"],
                          ctl=broker.ctl, clean_broker=False) as faults:
            yield Private(faults, broker, redis)


@pytest.fixture
def system(private: Private) -> Private:
    private.faults.restore()
    return private


def test_a_broker_restart_fails_no_job_and_judges_no_site(system: Private) -> None:
    outcome = system.faults.verify(restart_broker(system.faults, system.broker))
    assert outcome.ok, outcome.describe()


def test_a_redis_crash_loses_no_job_and_the_system_carries_on(system: Private) -> None:
    outcome = system.faults.verify(restart_redis(system.faults, system.redis, delay=0.5))
    assert outcome.ok, outcome.describe()

