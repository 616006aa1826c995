"""A job's shared log lines in Redis, readable while it runs and after it ends.

Keys (`Names`), all in the job's own hash slot and deleted with the job
(`RedisStateStore.delete_job`):

* `{ns:job:<id>}:logs`: a stream, one entry per line, fields `site` (a site, or "server"),
  `source` ("server" / "client_job"), `line`; capped at about `MAX_LINES` entries (XADD
  MAXLEN ~: the oldest go first). An entry's id (`<ms>-<seq>`) orders it; readers page with it.
* `{ns:job:<id>}:logs:errors`: a hash site -> its last error line (`lines.error_summary`).
* `{ns:job:<id>}:logs:seen`: a hash site -> the byte ranges of its log file already stored
  (`s:e,s:e`, at most `MAX_RANGES`): a line is stored once even when sent again.
* `{ns:job:<id>}:logs:sites`: a hash site -> `done` (its last line is in) or `private` (it does
  not share its logs).

Delivery is at least once (a redelivered message; a site agent restarted after it published a
batch but before it saved its position sends it again); storage is once: each line carries its
end offset in its file and `append` skips every line whose bytes an earlier batch stored, in the
same script as the write, whatever order batches arrive in (several job-runners share the
queue). Nothing is written for a job that does not exist: the scripts check the job's live mark
(`Names.job_live_key`, in the same slot; the record is in the namespace's), so lines that arrive
after the job was deleted do not bring its keys back.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from fedhive.config import Settings
from fedhive.errors import InvalidArgument
from fedhive.joblogs.lines import Line, error_summary
from fedhive.joblogs.wire import LogEntry
from fedhive.names import Names
from fedhive.state import connect

MAX_LINES = 20_000  # per job, approximately
MAX_RANGES = 64  # stored byte ranges per site; past it the lowest two are merged (lines
# between them would then count as stored: only batches far out of order lose any)
PAGE = 500  # lines per read, at most
PAGE_BYTES = 1024 * 1024  # bytes of lines per read, about
_SCAN = 1000  # stream entries per XRANGE while reading
_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
DONE, PRIVATE = "done", "private"

# KEYS: job live mark, stream, seen, errors, sites. ARGV: site, source, maxlen, start, eof (1/0),
# error end (0: none), error text, then (end, text) per line. Answers -1 (no such job) or the
# number of lines stored.
_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local site, source, maxlen = ARGV[1], ARGV[2], ARGV[3]
local ranges = {}
for s, e in string.gmatch(redis.call('HGET', KEYS[3], site) or '', '(%d+):(%d+)') do
  ranges[#ranges + 1] = {tonumber(s), tonumber(e)}
end
local function stored(s, e)
  for _, r in ipairs(ranges) do
    if r[1] <= s and e <= r[2] then return true end
  end
  return false
end
local from, count, err_end, error_stored = tonumber(ARGV[4]), 0, tonumber(ARGV[6]), false
local first = from
for i = 8, #ARGV, 2 do
  local e = tonumber(ARGV[i])
  if not stored(from, e) then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', maxlen, '*', 'site', site, 'source', source,
               'line', ARGV[i + 1])
    count = count + 1
    if e == err_end then error_stored = true end
  end
  from = e
end
if from > first then
  ranges[#ranges + 1] = {first, from}
  table.sort(ranges, function(a, b) return a[1] < b[1] end)
  local merged = {}
  for _, r in ipairs(ranges) do
    local last = merged[#merged]
    if last and r[1] <= last[2] then
      if r[2] > last[2] then last[2] = r[2] end
    else
      merged[#merged + 1] = {r[1], r[2]}
    end
  end
  while #merged > MAX_RANGES do  -- a bound on the script's work: the lowest two merge
    merged[2][1] = merged[1][1]
    table.remove(merged, 1)
  end
  local parts = {}
  for _, r in ipairs(merged) do
    parts[#parts + 1] = string.format('%.0f:%.0f', r[1], r[2])
  end
  redis.call('HSET', KEYS[3], site, table.concat(parts, ','))
end
if error_stored then redis.call('HSET', KEYS[4], site, ARGV[7]) end
if ARGV[5] == '1' then redis.call('HSET', KEYS[5], site, 'done') end
return count
""".replace("MAX_RANGES", str(MAX_RANGES))

# KEYS: job live mark, sites. ARGV: site, state. Answers 0 (no such job) or 1.
_MARK = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


@dataclass(frozen=True)
class LogPage:
    lines: list[LogEntry]
    more: bool  # more lines were stored after the last one (a later read gets them)


class JobLogStore:
    """The log lines of jobs on one Redis (see the module)."""

    def __init__(self, client: connect.RedisClient, names: Names, *,
                 max_lines: int = MAX_LINES) -> None:
        self._client = client
        self._names = names
        self._max_lines = max_lines
        self._append = client.register_script(_APPEND)
        self._mark = client.register_script(_MARK)

    @classmethod
    def from_settings(cls, settings: Settings) -> JobLogStore:
        return cls(connect.redis_client(settings), Names(settings.namespace))

    def close(self) -> None:
        self._client.close()

    # writing (the job-runner) ---------------------------------------------------------------
    def append(self, job_id: str, site: str, source: str, start: int, lines: Sequence[Line],
               *, eof: bool = False) -> int | None:
        """Store the lines of `site`'s log that start at byte `start`, but those already stored
        (see the module); the last error among the stored ones becomes the site's last error;
        `eof` marks the site done. Returns how many lines were stored, None when the job does
        not exist. Raises `redis.RedisError` when Redis cannot be reached."""
        n = self._names
        errors = [line for line in lines if line.error]
        last = errors[-1] if errors else None
        args: list[Any] = [site, source, self._max_lines, start, 1 if eof else 0,
                           last.end if last else 0, error_summary(last.text) if last else ""]
        for line in lines:
            args += [line.end, line.text]
        keys = [n.job_live_key(job_id), n.job_logs_key(job_id), n.job_log_seen_key(job_id),
                n.job_log_errors_key(job_id), n.job_log_sites_key(job_id)]
        count = int(cast(int, self._append(keys=keys, args=args)))
        return None if count < 0 else count

    def mark(self, job_id: str, site: str, state: str) -> bool:
        """Record `site` as `DONE` or `PRIVATE` for the job; False when the job does not
        exist."""
        keys = [self._names.job_live_key(job_id), self._names.job_log_sites_key(job_id)]
        return bool(self._mark(keys=keys, args=[site, state]))

    def stored_up_to(self, job_id: str, site: str) -> int:
        """The end of the last byte range of `site`'s log stored (0: none): where a single
        writer (the runner, for its server jobs' logs) goes on after a restart."""
        raw = self._client.hget(self._names.job_log_seen_key(job_id), site)
        ends = [int(part.partition(":")[2] or 0) for part in str(raw or "").split(",") if part]
        return max(ends, default=0)

    # reading (the job-store) ----------------------------------------------------------------
    def read(self, job_id: str, *, after: str = "", site: str = "", limit: int = PAGE,
             max_bytes: int = PAGE_BYTES) -> LogPage:
        """Up to `limit` lines (about `max_bytes`) after the line `after` ("" from the oldest
        kept), of `site` only when given. InvalidArgument for an `after` that is no line id."""
        if after and not _ID.match(after):
            raise InvalidArgument(f"after {after[:40]!r} is not a log line id (<ms>-<seq>)",
                                  field="after")
        key = self._names.job_logs_key(job_id)
        lines: list[LogEntry] = []
        size = 0
        start = f"({after}" if after else "-"
        while True:
            entries = cast(list[tuple[str, dict[str, str]]],
                           self._client.xrange(key, min=start, max="+", count=_SCAN))
            for entry_id, fields in entries:
                if len(lines) >= limit or size >= max_bytes:
                    return LogPage(lines, True)
                if site and fields.get("site") != site:
                    continue
                text = fields.get("line", "")
                lines.append(LogEntry(entry_id, fields.get("site", ""),
                                      fields.get("source", ""), text))
                size += len(text) + 64
            if len(entries) < _SCAN:
                return LogPage(lines, False)
            start = f"({entries[-1][0]}"

    def last_errors(self, job_id: str) -> dict[str, str]:
        """site (or "server") -> its last error line; {} when none."""
        found = self._client.hgetall(self._names.job_log_errors_key(job_id))
        return {str(k): str(v) for k, v in cast(dict[str, str], found).items()}

    def sites(self, job_id: str) -> dict[str, str]:
        """site -> `DONE` or `PRIVATE`, for the sites marked so."""
        found = self._client.hgetall(self._names.job_log_sites_key(job_id))
        return {str(k): str(v) for k, v in cast(dict[str, str], found).items()}
