"""Settings from the environment: defaults, TLS URLs, and one-line errors naming the variable."""

from pathlib import Path

import pytest

from fedhive.config import Settings, child_environment
from fedhive.errors import ConfigError


def test_defaults_point_at_local_services() -> None:
    settings = Settings.from_env({})
    assert settings.amqp_url.startswith("amqp://")
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.s3_endpoint_url is None  # real AWS S3
    assert settings.namespace == "fedhive"
    assert settings.inline_threshold == 2 * 1024 * 1024


def test_managed_cloud_urls_are_accepted() -> None:
    settings = Settings.from_env(
        {
            "FEDHIVE_AMQP_URL": "amqps://site1:pw@b-123.mq.eu-west-1.amazonaws.com:5671/%2F",
            "FEDHIVE_REDIS_URL": "rediss://:token@master.cache.amazonaws.com:6379/0",
            "FEDHIVE_S3_BUCKET": "acme-fl.models",
            "AWS_REGION": "eu-west-1",
            "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
            "AWS_SECRET_ACCESS_KEY": "secret",
        }
    )
    assert settings.amqp_tls
    assert settings.s3_region == "eu-west-1"
    assert settings.s3_bucket == "acme-fl.models"


def test_secrets_are_not_in_repr() -> None:
    settings = Settings.from_env(
        {
            "FEDHIVE_AMQP_URL": "amqp://u:hunter2@h/",
            "AWS_ACCESS_KEY_ID": "AKIAX",
            "AWS_SECRET_ACCESS_KEY": "hunter3",
        }
    )
    assert "hunter2" not in repr(settings) and "hunter3" not in repr(settings)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("FEDHIVE_AMQP_URL", "http://localhost:5672"),
        ("FEDHIVE_AMQP_URL", "amqp://:99999999/"),
        ("FEDHIVE_REDIS_URL", "memcached://localhost"),
        ("FEDHIVE_REDIS_URL", "redis://"),
        ("FEDHIVE_S3_ENDPOINT_URL", "ftp://minio:9000"),
        ("FEDHIVE_S3_PUBLIC_ENDPOINT_URL", "s3.example.com:9000"),
        ("FEDHIVE_S3_PUBLIC_ENDPOINT_URL", "https://"),
        ("FEDHIVE_S3_BUCKET", "Bad_Bucket"),
        ("FEDHIVE_NAMESPACE", "has space"),
        ("FEDHIVE_NAMESPACE", "x" * 41),
        ("FEDHIVE_INLINE_THRESHOLD", "2MiB"),
        ("FEDHIVE_INLINE_THRESHOLD", "-1"),
        ("FEDHIVE_LOG_LEVEL", "LOUD"),
        ("AWS_ACCESS_KEY_ID", "AKIA-without-secret"),
    ],
)
def test_invalid_setting_names_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env({variable: value})
    message = str(caught.value)
    assert "\n" not in message
    if variable == "AWS_ACCESS_KEY_ID":
        assert "AWS_SECRET_ACCESS_KEY" in message
    else:
        assert variable in message
        assert caught.value.field == variable


def test_public_s3_endpoint_defaults_to_the_endpoint_and_is_a_url() -> None:
    assert Settings.from_env({}).s3_public_endpoint_url is None  # sites use s3_endpoint_url
    settings = Settings.from_env({
        "FEDHIVE_S3_ENDPOINT_URL": "http://seaweedfs:8333",
        "FEDHIVE_S3_PUBLIC_ENDPOINT_URL": "https://s3.fl.example.org",
    })
    assert settings.s3_endpoint_url == "http://seaweedfs:8333"
    assert settings.s3_public_endpoint_url == "https://s3.fl.example.org"


def test_blank_values_mean_default() -> None:
    assert Settings.from_env({"FEDHIVE_NAMESPACE": "  "}).namespace == "fedhive"


def test_settings_are_frozen() -> None:
    settings = Settings()
    with pytest.raises(AttributeError):
        settings.namespace = "other"  # type: ignore[misc]


def test_a_child_environment_drops_what_it_is_told_and_takes_the_extras(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FEDHIVE_AMQP_URL", "amqp://site:secret@broker/")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("FEDHIVE_LOG_LEVEL", "DEBUG")
    env = child_environment({"FEDHIVE_SITE": "site-1"}, drop=("FEDHIVE_AMQP_URL", "AWS_"))
    assert "FEDHIVE_AMQP_URL" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["FEDHIVE_LOG_LEVEL"] == "DEBUG" and env["FEDHIVE_SITE"] == "site-1"
    assert child_environment()["FEDHIVE_AMQP_URL"] == "amqp://site:secret@broker/"


def test_ca_files_are_read_and_must_exist(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    settings = Settings.from_env({"FEDHIVE_AMQP_CA_FILE": str(ca),
                                  "FEDHIVE_REDIS_CA_FILE": str(ca), "AWS_CA_BUNDLE": str(ca)})
    assert (settings.amqp_ca_file, settings.redis_ca_file, settings.s3_ca_file) == (
        str(ca), str(ca), str(ca))
    assert Settings.from_env({}).amqp_ca_file is None  # the system's trust store
    with pytest.raises(ConfigError, match=r"FEDHIVE_REDIS_CA_FILE=.*is not a file"):
        Settings.from_env({"FEDHIVE_REDIS_CA_FILE": str(ca) + ".missing"})
    with pytest.raises(ConfigError, match=r"AWS_CA_BUNDLE=.*is not a file"):
        Settings.from_env({"AWS_CA_BUNDLE": str(ca) + ".missing"})


def test_redis_cluster_flag() -> None:
    assert Settings.from_env({}).redis_cluster is False
    for value, expected in (("1", True), ("true", True), ("YES", True), ("0", False),
                            ("no", False)):
        assert Settings.from_env({"FEDHIVE_REDIS_CLUSTER": value}).redis_cluster is expected
    with pytest.raises(ConfigError, match=r"^FEDHIVE_REDIS_CLUSTER='on' must be 1 or 0"):
        Settings.from_env({"FEDHIVE_REDIS_CLUSTER": "on"})


@pytest.mark.parametrize(("url", "problem"), [
    ("unix:///run/redis.sock", "not unix://"),
    ("redis://cache:6379/2", "names database '2': a Redis Cluster has database 0 only"),
])
def test_a_cluster_url_is_tcp_and_database_0(url: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as raised:
        Settings.from_env({"FEDHIVE_REDIS_CLUSTER": "1", "FEDHIVE_REDIS_URL": url})
    assert raised.value.field == "FEDHIVE_REDIS_URL"
    cluster = Settings.from_env({"FEDHIVE_REDIS_CLUSTER": "1",
                                 "FEDHIVE_REDIS_URL": "rediss://cfg.cache.amazonaws.com:6379"})
    assert cluster.redis_cluster and cluster.redis_url.startswith("rediss://")
