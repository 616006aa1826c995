"""Shared fixtures: real RabbitMQ, Redis and S3 (see tests/fixtures/infra.py), one namespace
per test so tests never see each other's queues, keys or objects."""

pytest_plugins = [
    "tests.fixtures.infra",
    "tests.fixtures.bus",
    "tests.fixtures.state",
    "tests.fixtures.blobs",
    "tests.fixtures.site_agent",
    "tests.fixtures.job_store",
    "tests.fixtures.gateway",
    "tests.fixtures.sites",
    "tests.fixtures.scheduler",
    "tests.fixtures.job_runner",
    "tests.fixtures.e2e",
    "tests.fixtures.fl",
]
