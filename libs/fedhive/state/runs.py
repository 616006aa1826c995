"""The job-runner's running-jobs table and the server-job (SJ) liveness and outcome records.

Kept in Redis, apart from the job record, so they outlive the processes that write them:

* the running-jobs table (`Names.runs_key`, a hash job_id -> JSON `RunEntry`): a job the runner
  took over and has not finished; a restarted runner reads it back to re-attach to its SJs;
* the SJ's liveness record (`Names.server_job_alive_key`), renewed by the SJ itself while it
  runs: a runner that is not the SJ's parent can still tell it is alive, and ask it to stop
  (`Names.server_job_stop_key`, read with each renewal) when it cannot signal it;
* the SJ's outcome (`Names.server_job_outcome_key`), written once by the SJ when it ends
  (first report wins), so the outcome does not depend on the runner being there to hear it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fedhive.config import Settings
from fedhive.errors import StaleFencingToken
from fedhive.names import Names
from fedhive.state import connect

OUTCOME_TTL_S = 7 * 24 * 3600


@dataclass(frozen=True)
class SiteState:
    """One site's part in a job, as the runner knows it (shown per site by `fedhive job`)."""

    token: str = ""  # the reservation check_resources returned
    allocated: bool = False
    deployed: bool = False
    started: bool = False
    excluded: str = ""  # why the site was left out of the job, when it was
    gone: str = ""  # why the SJ was told the site is gone, when it was
    reported: bool = False  # the site sent a heartbeat for the job at least once
    seen_online: bool = False  # the registry had the site online while the job ran
    last_heartbeat_ms: int = 0  # the site's last heartbeat for the job, 0 before the first
    started_at_ms: int = 0  # when the site started the client job, by the site's clock
    ended: str = ""  # how the client job ended, once its site said so


@dataclass(frozen=True)
class RunEntry:
    job_id: str
    runner: str  # the holder id of the runner that owns the job
    fence_token: int  # the runner's job-ownership lease token
    phase: str  # deploying, starting, running
    sites: dict[str, SiteState] = field(default_factory=dict)
    workspace: str = ""  # the SJ's workspace folder on the runner host
    host: str = ""  # the host the SJ runs on: its pid means something there only
    pid: int = 0  # the SJ process (and process group) id, 0 before launch
    pid_started: float = 0.0  # the SJ's process create time, so a reused pid is never killed

    def with_site(self, site: str, **changes: Any) -> RunEntry:
        sites = dict(self.sites)
        sites[site] = replace(sites.get(site, SiteState()), **changes)
        return replace(self, sites=sites)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunEntry:
        values = json.loads(text)
        values["sites"] = {k: SiteState(**v) for k, v in values.get("sites", {}).items()}
        return cls(**values)


@dataclass(frozen=True)
class Outcome:
    """How the SJ ended: `completed`, or `exception` with the error text."""

    result: str
    error: str = ""

    @property
    def completed(self) -> bool:
        return self.result == "completed"


# A running-jobs entry is written (or removed) only by a holder of the job's current token:
# a runner frozen past its lease, resuming mid-tick, must not put its entry (the old token)
# back over its successor's, which would leave the job with an owner that cannot renew.
_FENCED_WRITE = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held and cjson.decode(held)['fence_token'] > tonumber(ARGV[2]) then return 0 end
if ARGV[3] == '' then redis.call('HDEL', KEYS[1], ARGV[1])
else redis.call('HSET', KEYS[1], ARGV[1], ARGV[3]) end
return 1
"""


class RunTable:
    """The records above on one Redis: single-key operations (the entry's writes fenced by its
    job-ownership token)."""

    def __init__(self, client: connect.RedisClient, names: Names) -> None:
        self._client = client
        self._names = names
        self._write = client.register_script(_FENCED_WRITE)

    @classmethod
    def from_settings(cls, settings: Settings) -> RunTable:
        return cls(connect.redis_client(settings), Names(settings.namespace))

    def close(self) -> None:
        self._client.close()

    # running-jobs table -----------------------------------------------------------------
    def put(self, entry: RunEntry) -> None:
        """Store `entry`; StaleFencingToken when the stored one has a newer token (another
        runner owns the job now)."""
        self._fenced(entry.job_id, entry.fence_token, entry.to_json())

    def get(self, job_id: str) -> RunEntry | None:
        text = self._client.hget(self._names.runs_key, job_id)
        return RunEntry.from_json(str(text)) if text else None

    def all(self) -> list[RunEntry]:
        values = self._client.hgetall(self._names.runs_key)
        return [RunEntry.from_json(str(text)) for _, text in sorted(values.items())]

    def remove(self, job_id: str, fence_token: int) -> None:
        """Drop the job's entry; StaleFencingToken as `put`."""
        self._fenced(job_id, fence_token, "")

    def _fenced(self, job_id: str, fence_token: int, value: str) -> None:
        if not self._write(keys=[self._names.runs_key], args=[job_id, fence_token, value]):
            raise StaleFencingToken(f"job {job_id}: its running-jobs entry is owned with a "
                                    f"newer token than {fence_token} (another job-runner took "
                                    "the job over)", field="fence_token")

    # server-job liveness and outcome ------------------------------------------------------
    def beat(self, job_id: str, pid: int, ttl_s: float) -> bool:
        """Renew the SJ's liveness record; True when a runner asked it to stop."""
        pipe = self._client.pipeline(transaction=False)
        pipe.set(self._names.server_job_alive_key(job_id), str(pid),
                 px=max(1, round(ttl_s * 1000)))
        pipe.exists(self._names.server_job_stop_key(job_id))
        return bool(pipe.execute()[1])

    def ask_stop(self, job_id: str) -> None:
        self._client.set(self._names.server_job_stop_key(job_id), "1", ex=OUTCOME_TTL_S)

    def alive(self, job_id: str) -> bool:
        return bool(self._client.exists(self._names.server_job_alive_key(job_id)))

    def report(self, job_id: str, outcome: Outcome) -> bool:
        """Keep the SJ's outcome unless one is kept already; True if this one was kept."""
        kept = self._client.set(self._names.server_job_outcome_key(job_id),
                                json.dumps(asdict(outcome)), nx=True, ex=OUTCOME_TTL_S)
        self._client.delete(self._names.server_job_alive_key(job_id))
        return bool(kept)

    def outcome(self, job_id: str) -> Outcome | None:
        text = self._client.get(self._names.server_job_outcome_key(job_id))
        return Outcome(**json.loads(str(text))) if text else None
