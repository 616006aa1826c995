#!/usr/bin/env bash
# Make sure the local RabbitMQ and Redis that tests and the demo use are installed and answering,
# bound to 127.0.0.1 only. Installs them with apt on a Debian/Ubuntu machine that lacks them
# (as root), (re)starts whichever does not answer, and waits until both do.
# Redis is started durable: append-only file fsynced every second, no RDB snapshots, its data,
# log and pid file in ~/.fedhive/redis/6379 (so a restart, by this script or by `fedhive poc
# start`, reloads the job records). A Redis already running is left as it is; when it keeps
# nothing on disk, a warning on stderr says so.
# `fedhive poc start` (and so `make demo`) does the same in Python (fedhive/poc/infra.py): keep
# the two in step (tests/unit/test_redis_durability.py compares the Redis command lines).
set -euo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # port seconds name
  for _ in $(seq 1 $(($2 * 5))); do port_open "$1" && return 0; sleep 0.2; done
  echo "ensure-infra: $3 did not answer on 127.0.0.1:$1 within $2 s" >&2
  return 1
}

redis_keeps_nothing() { # no AOF and no save schedule (CONFIG refused, no redis-cli: unknown)
  local config
  config=$({ redis-cli -p 6379 --raw config get appendonly &&
    redis-cli -p 6379 --raw config get save; } 2>/dev/null) || return 1
  [ "$config" = $'appendonly\nno\nsave' ]
}

missing=()
command -v rabbitmq-server >/dev/null 2>&1 || missing+=(rabbitmq-server)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
if ((${#missing[@]})); then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure-infra: installing ${missing[*]} with apt" >&2
    apt-get update -q >/dev/null
    # Keep the packages' scripts from starting services (no init system in containers); we
    # start them below, bound to loopback.
    policy=/usr/sbin/policy-rc.d
    [ -e "$policy" ] || { printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; trap 'rm -f "$policy"' EXIT; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  else
    echo "ensure-infra: missing ${missing[*]}: install them (Debian/Ubuntu: apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

redis_dir="$HOME/.fedhive/redis/6379"
if ! port_open 6379; then
  echo "ensure-infra: starting Redis (data in $redis_dir)" >&2
  mkdir -p -m 700 "$redis_dir"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --dir "$redis_dir" \
    --appendonly yes --appendfsync everysec --save '' --logfile "$redis_dir/redis.log" \
    --pidfile "$redis_dir/redis.pid"
elif redis_keeps_nothing; then
  echo "ensure-infra: warning: the Redis at 127.0.0.1:6379 keeps nothing on disk (appendonly no," \
    "no save schedule): a Redis restart would lose every job record; turn its AOF on" \
    "(redis-cli CONFIG SET appendonly yes, and \`appendonly yes\`, \`appendfsync everysec\` in" \
    "its redis.conf)" >&2
fi

if ! port_open 5672; then
  echo "ensure-infra: starting RabbitMQ" >&2
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 ERL_EPMD_ADDRESS=127.0.0.1
  rabbitmq-server -detached
fi

wait_port 6379 30 Redis
wait_port 5672 90 RabbitMQ
rabbitmqctl await_startup --timeout 60 >/dev/null 2>&1 || true
