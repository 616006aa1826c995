"""What the Redis adapter of the state port stands on: one client (standalone, replicated,
Sentinel or Cluster: `fedhive.state.connect`), calls retried with the shared `Backoff` policy
and then surfaced as `Unavailable`, a certificate not accepted or cluster mode set wrong a
ConfigError at once, and Lua scripts run by their digest (loaded again after a restart)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import structlog
from redis.cluster import RedisCluster
from redis.exceptions import MovedError

from fedhive.config import Settings
from fedhive.errors import Unavailable
from fedhive.names import Names
from fedhive.retry import Backoff
from fedhive.state import connect, scripts

T = TypeVar("T")
R = TypeVar("R", bound="RedisBase")
log = structlog.get_logger()

DEFAULT_BACKOFF = Backoff(base=0.05, cap=1.0, max_attempts=6)
# MovedError: on a cluster client, a slot that moved again while redis-py followed it.
_TRANSIENT = (redis.ConnectionError, redis.TimeoutError, MovedError)


def ms(seconds: float) -> int:
    """A TTL in whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))


class RedisBase:
    """A Redis client with the adapter's retries and error translation."""

    def __init__(
        self, client: connect.RedisClient, names: Names, *, where: str,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self._client = client
        self._cluster = isinstance(client, RedisCluster)
        self._names = names
        self._where = where  # host:port, for error messages (never the password)
        self._backoff = backoff

    @classmethod
    def from_settings(
        cls: type[R], settings: Settings, *, backoff: Backoff = DEFAULT_BACKOFF
    ) -> R:
        return cls(connect.redis_client(settings), Names(settings.namespace),
                   where=connect.where(settings), backoff=backoff)

    def close(self) -> None:
        self._client.close()

    # plumbing -------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        def on_retry(err: BaseException, wait: float) -> None:
            log.warning("redis_retry", op=what, error=str(err), wait_s=round(wait, 3))

        def attempt() -> T:
            try:
                return fn()
            except redis.RedisError as err:
                problem = connect.config_problem(err, self._where, cluster=self._cluster)
                if problem is not None:
                    raise problem from None  # no retry helps
                raise

        try:
            return self._backoff.call(attempt, _TRANSIENT, on_retry)
        except _TRANSIENT as err:
            raise Unavailable(f"redis at {self._where} unavailable for {what}: {err}") from err

    def _script(
        self, what: str, script: scripts.LuaScript, keys: Sequence[str], args: Sequence[Any]
    ) -> Any:
        def run() -> Any:
            try:
                return self._client.evalsha(script.sha, len(keys), *keys, *args)
            except redis.exceptions.NoScriptError:
                return self._client.eval(script.source, len(keys), *keys, *args)

        return self._call(what, run)
