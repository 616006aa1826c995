"""Settings: built once from the environment by each process's composition root, then passed down.

This is the only module that reads the environment (also for what a child process inherits).
Invalid settings raise `ConfigError` whose one-line message names the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from fedhive.errors import ConfigError

_NAMESPACE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")
# S3 bucket naming rules (lower case, 3-63 chars, no leading/trailing dot or dash).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
MiB = 1024 * 1024


@dataclass(frozen=True)
class Settings:
    amqp_url: str = field(default="amqp://guest:guest@127.0.0.1:5672/%2F", repr=False)
    redis_url: str = field(default="redis://127.0.0.1:6379/0", repr=False)
    # PEM files of the CAs that sign the broker's / Redis's TLS certificates (amqps://,
    # rediss://). None: the system's trust store (what Amazon MQ, ElastiCache and CloudAMQP need).
    amqp_ca_file: str | None = None
    redis_ca_file: str | None = None
    # FEDHIVE_REDIS_CLUSTER=1: the Redis is a Redis Cluster (ElastiCache / Memorystore cluster
    # mode); the URL names any one of its nodes (`fedhive.state.connect`).
    redis_cluster: bool = False
    s3_endpoint_url: str | None = None  # None: real AWS S3
    # Where sites reach S3, when not at `s3_endpoint_url` (another address, a proxy): presigned
    # URLs handed to sites are signed for it. None: the same as `s3_endpoint_url`.
    s3_public_endpoint_url: str | None = None
    # PEM of the CA that signs an https:// S3 endpoint's certificate (AWS_CA_BUNDLE, the variable
    # boto3 reads); None: the system's trust store. The services' boto3 calls and reads use it.
    s3_ca_file: str | None = None
    s3_bucket: str = "fedhive"
    s3_region: str = "us-east-1"
    aws_access_key_id: str | None = field(default=None, repr=False)
    aws_secret_access_key: str | None = field(default=None, repr=False)
    aws_session_token: str | None = field(default=None, repr=False)
    namespace: str = "fedhive"
    inline_threshold: int = 2 * MiB  # arrays up to this many bytes travel inside messages
    log_level: str = "INFO"
    # Where a service writes its readiness (`fedhive.readiness`); None: a per-service default.
    ready_file: str | None = None
    ready_interval_s: float = 5.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        defaults = cls()

        def get(name: str, default: str | None) -> str | None:
            value = env.get(name)
            return default if value is None or value.strip() == "" else value.strip()

        values: dict[str, Any] = {
            "amqp_url": _url(
                "FEDHIVE_AMQP_URL", get("FEDHIVE_AMQP_URL", defaults.amqp_url), ("amqp", "amqps")
            ),
            "redis_url": _url(
                "FEDHIVE_REDIS_URL",
                get("FEDHIVE_REDIS_URL", defaults.redis_url),
                ("redis", "rediss", "unix"),
            ),
            "redis_cluster": _flag("FEDHIVE_REDIS_CLUSTER", get("FEDHIVE_REDIS_CLUSTER", "0")),
            "s3_bucket": _match(
                "FEDHIVE_S3_BUCKET",
                get("FEDHIVE_S3_BUCKET", defaults.s3_bucket),
                _BUCKET,
                "a valid S3 bucket name (3-63 chars: a-z, 0-9, '.', '-')",
            ),
            "namespace": _match(
                "FEDHIVE_NAMESPACE",
                get("FEDHIVE_NAMESPACE", defaults.namespace),
                _NAMESPACE,
                "1-40 chars of a-z, 0-9, '_' or '-', starting with a letter or digit",
            ),
            "s3_region": get("AWS_REGION", get("AWS_DEFAULT_REGION", defaults.s3_region)),
            "aws_access_key_id": get("AWS_ACCESS_KEY_ID", None),
            "aws_secret_access_key": get("AWS_SECRET_ACCESS_KEY", None),
            "aws_session_token": get("AWS_SESSION_TOKEN", None),
            "inline_threshold": _int(
                "FEDHIVE_INLINE_THRESHOLD",
                get("FEDHIVE_INLINE_THRESHOLD", str(defaults.inline_threshold)),
            ),
        }
        for attribute, name in (("amqp_ca_file", "FEDHIVE_AMQP_CA_FILE"),
                                ("redis_ca_file", "FEDHIVE_REDIS_CA_FILE"),
                                ("s3_ca_file", "AWS_CA_BUNDLE")):
            values[attribute] = _file(name, get(name, None))
        endpoint = get("FEDHIVE_S3_ENDPOINT_URL", None)
        values["s3_endpoint_url"] = (
            None
            if endpoint is None
            else _url("FEDHIVE_S3_ENDPOINT_URL", endpoint, ("http", "https"))
        )
        public = get("FEDHIVE_S3_PUBLIC_ENDPOINT_URL", None)
        values["s3_public_endpoint_url"] = (
            None
            if public is None
            else _url("FEDHIVE_S3_PUBLIC_ENDPOINT_URL", public, ("http", "https"))
        )
        level = (get("FEDHIVE_LOG_LEVEL", defaults.log_level) or "").upper()
        if level not in _LOG_LEVELS:
            raise ConfigError(
                f"FEDHIVE_LOG_LEVEL={level!r} is not one of {', '.join(_LOG_LEVELS)}",
                field="FEDHIVE_LOG_LEVEL",
            )
        values["log_level"] = level
        values["ready_file"] = get("FEDHIVE_READY_FILE", None)
        values["ready_interval_s"] = _seconds(
            "FEDHIVE_READY_INTERVAL", get("FEDHIVE_READY_INTERVAL", str(defaults.ready_interval_s)))
        if bool(values["aws_access_key_id"]) != bool(values["aws_secret_access_key"]):
            raise ConfigError(
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together",
                field="AWS_SECRET_ACCESS_KEY",
            )
        if values["redis_cluster"]:
            _cluster_url(values["redis_url"])
        return cls(**values)

    def with_namespace(self, namespace: str) -> Settings:
        return replace(self, namespace=_match("namespace", namespace, _NAMESPACE, "a namespace"))

    @property
    def amqp_tls(self) -> bool:
        return self.amqp_url.startswith("amqps://")


def child_environment(extra: Mapping[str, str] | None = None, *,
                      drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment to hand a child process (a server or client job, a trainer): this
    process's own (PATH, PYTHONPATH, locale, the FEDHIVE_*/AWS_* variables its Settings came
    from) less the variables whose names start with one of `drop` (credentials a trainer must
    not get), plus `extra`, which wins (e.g. the CUDA_VISIBLE_DEVICES of a resource consumer)."""
    kept = {name: value for name, value in os.environ.items()
            if not (drop and name.startswith(drop))}
    return {**kept, **(extra or {})}


def environment_values(names: Sequence[str], environ: Mapping[str, str] | None = None,
                       ) -> dict[str, str | None]:
    """The values of `names` in `environ` (this process's environment by default; None:
    unset); a child job reports what its parent set for it."""
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name in names}


def _url(name: str, value: str | None, schemes: tuple[str, ...]) -> str:
    assert value is not None
    parts = urlsplit(value)
    if parts.scheme not in schemes:
        raise ConfigError(
            f"{name} must use scheme {' or '.join(s + '://' for s in schemes)}, got "
            f"{parts.scheme or 'none'!r}",
            field=name,
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise ConfigError(f"{name} has no host", field=name)
    try:
        parts.port  # noqa: B018 - raises ValueError for a non-numeric or out-of-range port
    except ValueError:
        raise ConfigError(f"{name} has an invalid port", field=name) from None
    return value


def _cluster_url(url: str) -> None:
    """A Redis Cluster is reached over TCP and has database 0 only."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        raise ConfigError("FEDHIVE_REDIS_URL must be redis:// or rediss:// with "
                          "FEDHIVE_REDIS_CLUSTER=1, not unix://", field="FEDHIVE_REDIS_URL")
    if parts.path.strip("/") not in ("", "0"):
        raise ConfigError(f"FEDHIVE_REDIS_URL names database {parts.path.strip('/')!r}: a Redis "
                          "Cluster has database 0 only", field="FEDHIVE_REDIS_URL")


def _file(name: str, value: str | None) -> str | None:
    if value is not None and not os.path.isfile(value):
        raise ConfigError(f"{name}={value!r} is not a file", field=name)
    return value


def _flag(name: str, value: str | None) -> bool:
    text = (value or "").lower()
    if text not in ("0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"{name}={value!r} must be 1 or 0 (true/false, yes/no)", field=name)
    return text in ("1", "true", "yes")


def _match(name: str, value: str | None, pattern: re.Pattern[str], what: str) -> str:
    if value is None or not pattern.match(value):
        raise ConfigError(f"{name}={value!r} must be {what}", field=name)
    return value


def _seconds(name: str, value: str | None, most: float = 3600) -> float:
    try:
        number = float(value or "")
    except ValueError:
        number = 0.0
    if not 0 < number <= most:
        raise ConfigError(f"{name}={value!r} must be a number of seconds above 0 (at most "
                          f"{most:g})", field=name)
    return number


def _int(name: str, value: str | None) -> int:
    try:
        number = int(value or "")
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer", field=name) from None
    if number < 0:
        raise ConfigError(f"{name}={number} must not be negative", field=name)
    return number
