"""The Lua scripts that make every job-record write atomic in Redis.

`render_change_status(TRANSITIONS)` generates the status compare-and-set from the state machine
constant: the allowed (from, to) pairs, the final statuses and the status that sets the start
time are rendered in from `fedhive.jobs.status`, so changing the constant changes the script.
Times come from Redis `TIME`, one clock for every host. Scripts that write a job answer
`{'OK', HGETALL(job), LRANGE(history)}` or `{<error code>, <current value>}` and check
everything before their first write, so a refused change leaves the record untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from string import Template

from fedhive.jobs.status import INITIAL, TRANSITIONS, JobStatus

# Error codes the scripts answer with; the adapter turns them into fedhive.errors types.
NOT_FOUND = "NOT_FOUND"
EXISTS = "EXISTS"
STALE_FENCE = "STALE_FENCE"
STALE_STATUS = "STALE_STATUS"
ILLEGAL = "ILLEGAL"
OK = "OK"
PAIR_SEPARATOR = ">"  # never part of a status string


@dataclass(frozen=True)
class LuaScript:
    source: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()


_PRELUDE = """
-- returns now as unix milliseconds and microseconds, both as exact decimal strings
local function now()
  local t = redis.call('TIME')
  local ms = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
  local us = t[1] .. string.format('%06d', tonumber(t[2]))
  return ms, us
end
local function fence_ok(fence_key, token)
  if token == '' then return true end
  return (redis.call('GET', fence_key) or '') == token
end
local function set_fields(job, first)
  for i = first, #ARGV, 2 do redis.call('HSET', job, ARGV[i], ARGV[i + 1]) end
end
local function history_entry(from, to, reason, at)
  return cjson.encode({['from'] = from, to = to, reason = reason, at = at})
end
local function record(job, history)
  return {'OK', redis.call('HGETALL', job), redis.call('LRANGE', history, 0, -1)}
end
"""

_CHANGE_STATUS = Template(
    """-- GENERATED from fedhive.jobs.status.TRANSITIONS by fedhive.state.scripts; do not edit.
-- KEYS: job, history, by-submit, by-status(expected), by-status(new) [, fence]
-- ARGV: job_id, expected, new, reason, fence token or '', field, value, ...
$prelude
local ALLOWED = {
$allowed
}
local FINAL = {
$final
}
local job_id, expected, new, reason, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('EXISTS', KEYS[1]) == 0 then return {'$not_found', ''} end
if not fence_ok(KEYS[6], token) then return {'$stale_fence', redis.call('GET', KEYS[6]) or ''} end
local current = redis.call('HGET', KEYS[1], 'status') or ''
if current ~= expected then return {'$stale_status', current} end
if not ALLOWED[current .. '$sep' .. new] then return {'$illegal', current} end
local score = redis.call('ZSCORE', KEYS[3], job_id) or '0'
local ms = now()
redis.call('HSET', KEYS[1], 'status', new)
if new == '$running' then redis.call('HSET', KEYS[1], 'start_time_ms', ms) end
if FINAL[new] then redis.call('HSET', KEYS[1], 'end_time_ms', ms) end
set_fields(KEYS[1], 6)
redis.call('ZREM', KEYS[4], job_id)
redis.call('ZADD', KEYS[5], score, job_id)
redis.call('RPUSH', KEYS[2], history_entry(current, new, reason, ms))
return record(KEYS[1], KEYS[2])
"""
)


def render_change_status(
    transitions: Iterable[tuple[JobStatus, JobStatus]] = TRANSITIONS,
) -> LuaScript:
    """The status compare-and-set, with `transitions` as its table of allowed changes."""
    allowed = "\n".join(
        f'  ["{old.value}{PAIR_SEPARATOR}{new.value}"] = true,' for old, new in sorted(transitions)
    )
    final = "\n".join(f'  ["{s.value}"] = true,' for s in JobStatus if s.is_final)
    return LuaScript(
        _CHANGE_STATUS.substitute(
            prelude=_PRELUDE,
            allowed=allowed,
            final=final,
            running=JobStatus.RUNNING.value,
            sep=PAIR_SEPARATOR,
            not_found=NOT_FOUND,
            stale_fence=STALE_FENCE,
            stale_status=STALE_STATUS,
            illegal=ILLEGAL,
        )
    )


CHANGE_STATUS = render_change_status()

CREATE_JOB = LuaScript(
    Template(
        """-- KEYS: job, history, by-submit, by-status(initial)
-- ARGV: job_id, reason, field, value, ...
$prelude
if redis.call('EXISTS', KEYS[1]) == 1 then return {'$exists', ''} end
local ms, us = now()
redis.call('HSET', KEYS[1], 'job_id', ARGV[1], 'status', '$initial', 'submit_time_ms', ms,
           'schedule_count', '0')
set_fields(KEYS[1], 3)
redis.call('ZADD', KEYS[3], us, ARGV[1])
redis.call('ZADD', KEYS[4], us, ARGV[1])
redis.call('RPUSH', KEYS[2], history_entry('', '$initial', ARGV[2], ms))
return record(KEYS[1], KEYS[2])
"""
    ).substitute(prelude=_PRELUDE, exists=EXISTS, initial=INITIAL.value)
)

UPDATE_JOB = LuaScript(
    Template(
        """-- KEYS: job, history [, fence]
-- ARGV: fence token or '', expected status or '', field, value, ...
$prelude
if redis.call('EXISTS', KEYS[1]) == 0 then return {'$not_found', ''} end
if not fence_ok(KEYS[3], ARGV[1]) then return {'$stale_fence', redis.call('GET', KEYS[3]) or ''} end
local status = redis.call('HGET', KEYS[1], 'status')
if ARGV[2] ~= '' and status ~= ARGV[2] then return {'$stale_status', status} end
set_fields(KEYS[1], 3)
return record(KEYS[1], KEYS[2])
"""
    ).substitute(prelude=_PRELUDE, not_found=NOT_FOUND, stale_fence=STALE_FENCE,
                 stale_status=STALE_STATUS)
)

# KEYS: job, history, by-submit, by-status(s) for every status (the namespace's slot).
DELETE_JOB = LuaScript(
    """-- ARGV: job id, how many of the first KEYS are the job's own keys (deleted; default 2);
-- the KEYS after them are indexes the id is removed from.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local own = tonumber(ARGV[2] or '2')
for i = 1, own do redis.call('DEL', KEYS[i]) end
for i = own + 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
return 1
"""
)

# Leases: KEYS lease (a hash: holder, token; expires), fence (a counter that never expires).
ACQUIRE_LEASE = LuaScript(
    """-- ARGV: holder, ttl_ms. Answers the token, or nil when another holder has the lease.
local holder = redis.call('HGET', KEYS[1], 'holder')
if holder and holder ~= ARGV[1] then return false end
if holder then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('HGET', KEYS[1], 'token'))
end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"""
)

RENEW_LEASE = LuaScript(
    """-- ARGV: holder, token, ttl_ms. Answers 1, or 0 when the token is no longer current.
-- A lapsed lease nobody took over (the fence still at this token) is taken back.
local holder = redis.call('HGET', KEYS[1], 'holder')
if holder then
  if holder ~= ARGV[1] or redis.call('HGET', KEYS[1], 'token') ~= ARGV[2] then return 0 end
else
  if (redis.call('GET', KEYS[2]) or '') ~= ARGV[2] then return 0 end
  redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

TAKE_OVER_LEASE = LuaScript(
    """-- ARGV: holder, previous, ttl_ms. Answers a new token, or nil when another holder has it.
local holder = redis.call('HGET', KEYS[1], 'holder')
if holder and holder ~= ARGV[1] and holder ~= ARGV[2] then return false end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'token', token)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return token
"""
)

RELEASE_LEASE = LuaScript(
    """-- ARGV: holder, token. Answers 1 when released, 0 when not held so.
if redis.call('HGET', KEYS[1], 'holder') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'token') == ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""
)
