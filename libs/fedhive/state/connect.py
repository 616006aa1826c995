"""The one place fedhive builds a Redis client from `Settings` (state store, round log, runs
table, job logs).

* `redis://` and `unix://`: plain. `rediss://`: TLS, the server's certificate and host name
  verified against the CA in FEDHIVE_REDIS_CA_FILE, else the system trust store (what
  ElastiCache and Memorystore need).
* FEDHIVE_REDIS_CLUSTER=1: a Redis Cluster (ElastiCache / Memorystore cluster mode); the URL
  names any one node, e.g. ElastiCache's configuration endpoint. The keys are laid out so each
  multi-key operation touches one hash slot (`fedhive.names`, DESIGN.md §4).

Cluster mode is a setting, not detected: detecting it (`INFO cluster`) would take a round trip
to Redis in every process before its first command, so a service would have to wait for Redis
while it starts; the operator chose cluster mode when creating the cache, so it knows. A wrong
choice is named in one line, never retried: a cluster node spoken to as a single Redis answers
MOVED, a single Redis refuses CLUSTER SLOTS (`config_problem`).

redis-py's own retries are off: callers retry with `fedhive.retry.Backoff`. Except once in a
cluster client, after it updated its slot map: a MULTI/EXEC answered MOVED (its slot moved:
resharding, failover) needs that retry to reach the slot's new node (redis-py follows MOVED
without one only for single commands and plain pipelines); a connection error is likewise
tried once more on the refreshed map.
"""

from __future__ import annotations

import re
import ssl
from typing import Any, TypeAlias
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import MovedError, RedisClusterException
from redis.retry import Retry

from fedhive.config import Settings
from fedhive.errors import ConfigError, Unavailable
from fedhive.retry import Backoff

RedisClient: TypeAlias = redis.Redis | RedisCluster
CONNECT_BACKOFF = Backoff(base=0.1, cap=1.0, max_attempts=6)  # a cluster's first contact
_VERIFY = re.compile(r"certificate verify failed: ([^(]+)")


def where(settings: Settings) -> str:
    """host:port (or the socket path) of the Redis, for messages: never the password."""
    parts = urlsplit(settings.redis_url)
    return f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else parts.path


def redis_client(settings: Settings, *, socket_timeout: float = 10.0,
                 connect_timeout: float = 5.0) -> RedisClient:
    """A client (decoding replies to str) for the Redis `settings` name. A cluster client
    reads the cluster's slot map here: ConfigError / Unavailable when it cannot."""
    options: dict[str, Any] = {
        "decode_responses": True,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "health_check_interval": 30,
    }
    if settings.redis_url.startswith("rediss://"):
        options.update(ssl_cert_reqs="required", ssl_check_hostname=True,
                       ssl_ca_certs=settings.redis_ca_file)
    if not settings.redis_cluster:
        return redis.Redis.from_url(settings.redis_url, retry=Retry(NoBackoff(), 0), **options)

    def connect() -> RedisCluster:
        try:
            return RedisCluster.from_url(settings.redis_url, retry=Retry(NoBackoff(), 1),
                                         **options)
        except (RedisClusterException, redis.RedisError) as err:
            problem = config_problem(err, where(settings))
            if problem is not None:
                raise problem from None
            raise

    try:
        return CONNECT_BACKOFF.call(connect, (RedisClusterException, redis.RedisError))
    except (RedisClusterException, redis.RedisError) as err:
        raise Unavailable(f"redis cluster at {where(settings)} unavailable: "
                          f"{_first_line(err)}") from None


def config_problem(err: BaseException, at: str, *, cluster: bool = False) -> ConfigError | None:
    """The ConfigError behind a redis-py error that no retry can help (a certificate not
    accepted, cluster mode set wrong); None for any other error. `cluster`: the client is a
    cluster client, for which MOVED means a slot moved again (a reshard): a retry helps."""
    problem = _certificate_problem(err)
    if problem is not None:
        return ConfigError(f"redis at {at} refused over TLS: {problem} (FEDHIVE_REDIS_CA_FILE "
                           "names the CA to trust; default: the system trust store)",
                           field="FEDHIVE_REDIS_CA_FILE")
    if isinstance(err, MovedError) and not cluster:
        return ConfigError(f"redis at {at} is a Redis Cluster node (it answered MOVED): set "
                           "FEDHIVE_REDIS_CLUSTER=1", field="FEDHIVE_REDIS_CLUSTER")
    if "cluster support disabled" in str(err) or "Cluster mode is not enabled" in str(err):
        return ConfigError(f"redis at {at} is not a Redis Cluster: unset FEDHIVE_REDIS_CLUSTER",
                           field="FEDHIVE_REDIS_CLUSTER")
    return None


def _certificate_problem(err: BaseException) -> str | None:
    """What the TLS handshake found wrong with the server's certificate, if that failed."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return f"certificate verify failed: {seen.verify_message}"
        seen = seen.__cause__ or seen.__context__
    found = _VERIFY.search(str(err))  # the cluster client keeps only the text
    return f"certificate verify failed: {found.group(1).strip()}" if found else None


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
