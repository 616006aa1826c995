"""The per-round metrics a job's workflows report, kept in Redis while the job runs.

The server job appends each finished round (`fedhive.fl.server_job.RoundReports`) to a list at
`Names.job_rounds_key(job_id)`, one JSON object per round, oldest first:

    {"workflow": str, "round": int (0-based), "num_rounds": int,
     "metrics": {"sites": {site: {name: value}}, "aggregate": {name: value}}, "at_ms": int}

The job-store reads it back for `fedhive metrics ID` (so metrics are visible before the job's
result exists); deleting the job deletes the list (`RedisStateStore.delete_job`). Numbers that
JSON cannot hold (NaN, infinities: a diverged loss) are stored as null. Only the newest
`MAX_ROUNDS` entries are kept; the job's `metrics.json` result keeps them all.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from fedhive.config import Settings
from fedhive.names import Names
from fedhive.state import connect

MAX_ROUNDS = 5_000


class RoundLog:
    """The round lists on one Redis; single-key operations, no scripts needed."""

    def __init__(self, client: connect.RedisClient, names: Names) -> None:
        self._client = client
        self._names = names

    @classmethod
    def from_settings(cls, settings: Settings) -> RoundLog:
        return cls(connect.redis_client(settings), Names(settings.namespace))

    def close(self) -> None:
        self._client.close()

    def append(self, job_id: str, report: Mapping[str, Any]) -> None:
        """Add one round at the end of the job's list (dropping the oldest past MAX_ROUNDS).
        Raises `redis.RedisError` when Redis cannot be reached; the caller decides."""
        text = json.dumps(_finite(dict(report)), sort_keys=True, allow_nan=False)
        key = self._names.job_rounds_key(job_id)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, text)
            pipe.ltrim(key, -MAX_ROUNDS, -1)
            pipe.execute()

    def read(self, job_id: str) -> list[dict[str, Any]]:
        """The job's rounds, oldest first; [] when it reported none (or is unknown)."""
        values = self._client.lrange(self._names.job_rounds_key(job_id), 0, -1)
        entries = [json.loads(str(text)) for text in values]
        return [entry for entry in entries if isinstance(entry, dict)]


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None, so it is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value
