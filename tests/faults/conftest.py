"""The fault suite's system: one for the whole package (tests/faults/harness.py's
`fault_system` on a namespace of its own, two sites), made whole again before every test
(`faults`). Each test breaks it one way, then checks every invariant over the jobs it made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.harness import Faults, fault_system
from tests.fixtures.infra import RUN_ID, S3Server, settings_for


@pytest.fixture(scope="package")
def fault_system_shared(amqp_url: str, redis_url: str, s3_server: S3Server, test_bucket: str,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faults]:
    settings = settings_for(amqp_url, redis_url, s3_server, test_bucket, f"t{RUN_ID}-faults")
    with fault_system(settings, tmp_path_factory.mktemp("faults"),
                      [f"f{RUN_ID}-a", f"f{RUN_ID}-b"]) as faults:
        yield faults


@pytest.fixture
def faults(fault_system_shared: Faults) -> Faults:
    fault_system_shared.restore()
    return fault_system_shared

