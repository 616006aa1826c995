"""The Lua scripts behind `SitePresence` in Redis: each transition is decided inside one script,
so of several intake replicas exactly one sees a site go online or offline.

Keys (from `Names`, all in the namespace's hash slot): `{ns}:sites` (zset site -> last
recorded `sent_at_ms`, i.e. every known site and when it was last seen), `{ns}:sites:online`
(set of sites announced online), `{ns}:sites:last` (hash site -> last heartbeat JSON, kept after
the live record expires) and `{ns}:site:<name>` (the live record, with the liveness TTL); and
one key per client job's last beat (`Names.job_heartbeat_key`, JSON, with the job TTL) in that
job's slot. Like every fedhive script they touch only the keys passed in KEYS, all in one slot
(a Redis Cluster requirement).
"""

from __future__ import annotations

from fedhive.state.scripts import LuaScript

# KEYS: sites zset, online set, last hash, then one live-record key per beat.
# ARGV: ttl_ms, then (site, sent_at_ms, heartbeat JSON) per beat.
# Returns the sites that went from offline to online.
RECORD_HEARTBEATS = LuaScript("""
local ttl = ARGV[1]
local born = {}
for i = 1, #KEYS - 3 do
  local site, sent, value = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  local last = redis.call('ZSCORE', KEYS[1], site)
  if not last or tonumber(sent) >= tonumber(last) then
    redis.call('SET', KEYS[3 + i], value, 'PX', ttl)
    redis.call('ZADD', KEYS[1], sent, site)
    redis.call('HSET', KEYS[3], site, value)
    if redis.call('SADD', KEYS[2], site) == 1 then born[#born + 1] = site end
  end
end
return born
""")

# KEYS: sites zset, online set, last hash, the site's live-record key.
# ARGV: site, sent_at_ms, heartbeat JSON.
# Returns 1 when this call took the site offline, 0 when it was not online, -1 when stale.
MARK_OFFLINE = LuaScript("""
local last = redis.call('ZSCORE', KEYS[1], ARGV[1])
if last and tonumber(ARGV[2]) < tonumber(last) then return -1 end
redis.call('DEL', KEYS[4])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return redis.call('SREM', KEYS[2], ARGV[1])
""")

# KEYS: online set, last hash, then the live-record key of each site in ARGV.
# ARGV: the sites the caller read from the online set (a site that went online since is not
# swept this time; one that went offline meanwhile is skipped).
# Returns (site, last heartbeat JSON or '') pairs, flattened, for the sites taken offline.
SWEEP_EXPIRED = LuaScript("""
local gone = {}
for i, site in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[2 + i]) == 0 and redis.call('SREM', KEYS[1], site) == 1 then
    gone[#gone + 1] = site
    gone[#gone + 1] = redis.call('HGET', KEYS[2], site) or ''
  end
end
return gone
""")

# KEYS: one job-heartbeat key per beat. ARGV: ttl_ms, then (heartbeat JSON, 1 if ended else 0)
# per beat. A beat that is not ended does not replace an ended one.
RECORD_JOB_HEARTBEATS = LuaScript("""
for i = 1, #KEYS do
  local value, ended = ARGV[2 * i], ARGV[2 * i + 1]
  local old = ended == '0' and redis.call('GET', KEYS[i])
  if not (old and cjson.decode(old).ended) then
    redis.call('SET', KEYS[i], value, 'PX', ARGV[1])
  end
end
return 0
""")
