"""The POC's RabbitMQ and Redis: what deploy/local/ensure-infra.sh does, as a library.

Each is used where FEDHIVE_AMQP_URL / FEDHIVE_REDIS_URL point (default: the local one). A local
one that does not answer is started, bound to 127.0.0.1 (installed first with apt when it is
missing on a Debian/Ubuntu machine and this runs as root); anything else that cannot be done
ends with one line naming the package and the command that fixes it. Remote ones are only
checked.

A Redis started here is durable: append-only file, fsync every second, in `redis_dir(port)`
(`~/.fedhive/redis/PORT`). A Redis that runs already is left as it is, but one that keeps
nothing on disk is named in a warning line: its restart would lose every job record.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fedhive.config import Settings, child_environment
from fedhive.errors import PocFailed

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
# Where a Redis that fedhive starts keeps its data, log and pid file: one folder per user and
# port, the same for every `fedhive poc start --dir` and for deploy/local/ensure-infra.sh, so
# whichever starts it next reloads the job records the last one kept.
REDIS_DATA = Path("~/.fedhive/redis")
Say = Callable[[str], None]


@dataclass(frozen=True)
class Service:
    key: str  # "rabbitmq" | "redis"
    title: str
    variable: str  # the setting naming it
    host: str
    port: int
    package: str  # Debian/Ubuntu package
    binary: str

    @property
    def local(self) -> bool:
        return self.host in LOCAL_HOSTS


def services(settings: Settings) -> list[Service]:
    amqp = urlsplit(settings.amqp_url)
    redis = urlsplit(settings.redis_url)
    tls_port = 5671 if amqp.scheme == "amqps" else 5672
    found = [Service("rabbitmq", "RabbitMQ", "FEDHIVE_AMQP_URL", amqp.hostname or "127.0.0.1",
                     amqp.port or tls_port, "rabbitmq-server", "rabbitmq-server")]
    if redis.scheme != "unix":  # a socket: the user runs it; it is only checked by use
        found.append(Service("redis", "Redis", "FEDHIVE_REDIS_URL", redis.hostname or "127.0.0.1",
                             redis.port or 6379, "redis-server", "redis-server"))
    return found


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout):
            return True
    except OSError:
        return False


def install_hint(package: str) -> str:
    if shutil.which("apt-get"):
        return f"sudo apt-get install -y {package}"
    if shutil.which("brew"):
        return f"brew install {package.removesuffix('-server')}"
    return f"install {package} with your package manager"


def ensure(settings: Settings, say: Say, started: list[str]) -> None:
    """Make RabbitMQ and Redis answer; appends the key of each one it starts to `started`
    (before waiting for it: a failure later still knows to stop it)."""
    for service in services(settings):
        if answers(service.host, service.port):
            continue
        if not service.local:
            raise PocFailed(f"{service.title} does not answer at {service.host}:{service.port} "
                            f"({service.variable}): start it, or unset {service.variable} to use "
                            "a local one")
        _install(service, say)
        say(f"starting {service.title} on 127.0.0.1:{service.port}")
        _start(service)
        started.append(service.key)
        _wait(service, 30 if service.key == "redis" else 90)
    if "rabbitmq" in started:
        # the port answers before the node accepts users and permissions
        _run(["rabbitmqctl", "await_startup", "--timeout", "60"], 90,
             "see RabbitMQ's log (/var/log/rabbitmq), or start it yourself")
    if "redis" in started:
        # the port answers while Redis still loads its append-only file (LOADING errors)
        _await_redis(settings.redis_url, 60)
    if "redis" not in started:  # the operator's own: told, never reconfigured behind their back
        warning = persistence_warning(settings.redis_url)
        if warning is not None:
            say(warning)


def redis_dir(port: int) -> Path:
    return (REDIS_DATA / str(port)).expanduser()


def redis_argv(port: int, data: Path) -> list[str]:
    """How fedhive starts Redis: on loopback, every write in the append-only file, fsynced every
    second (a crash of Redis loses nothing, one of the machine at most the last second). No RDB
    snapshots: the AOF alone restores everything (its rewrites are compacted with an RDB
    preamble), and snapshots would add forks and a second copy for nothing."""
    return ["redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", str(port),
            "--dir", str(data), "--appendonly", "yes", "--appendfsync", "everysec",
            "--save", "", "--logfile", str(data / "redis.log"),
            "--pidfile", str(data / "redis.pid")]


def persistence_warning(url: str) -> str | None:
    """One line when the Redis at `url` keeps nothing on disk (no AOF, no RDB save schedule);
    None when it does, or when it cannot tell (managed Redis such as ElastiCache refuses
    CONFIG; it keeps data by replicas and snapshots)."""
    import redis

    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=3,
                                  socket_connect_timeout=3)
    try:
        appendonly = client.config_get("appendonly").get("appendonly")
        save = client.config_get("save").get("save")
    except redis.RedisError:
        return None
    finally:
        client.close()
    if appendonly != "no" or save != "":
        return None
    parts = urlsplit(url)
    where = (parts.path if parts.scheme == "unix"
             else f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}")
    return (f"warning: the Redis at {where} (FEDHIVE_REDIS_URL) keeps nothing on disk "
            "(appendonly no, no save schedule): a Redis restart would lose every job record; "
            "turn its AOF on (redis-cli CONFIG SET appendonly yes, and `appendonly yes`, "
            "`appendfsync everysec` in its redis.conf)")


def _install(service: Service, say: Say) -> None:
    if shutil.which(service.binary):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise PocFailed(f"{service.title} is not installed ({service.binary} not found): "
                        f"{install_hint(service.package)}, {_or_elsewhere(service)}")
    say(f"installing {service.package} with apt")
    policy = Path("/usr/sbin/policy-rc.d")  # keep the package's scripts from starting it
    made = not policy.exists()
    if made:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    fix = (f"make apt work and run `apt-get install -y {service.package}`, "
           f"{_or_elsewhere(service)}")
    try:
        env = child_environment({"DEBIAN_FRONTEND": "noninteractive"})
        for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q",
                                                  service.package]):
            done = _run(argv, 600, fix, env=env)
            if done.returncode != 0:
                raise PocFailed(f"{service.title} is not installed and `{' '.join(argv)}` "
                                f"failed ({_last_line(done)}): {fix}")
    finally:
        if made:
            policy.unlink(missing_ok=True)


def _or_elsewhere(service: Service) -> str:
    return f"or set {service.variable} to a {service.title} that runs"


def _run(argv: list[str], seconds: int, fix: str, **options: Any) -> \
        subprocess.CompletedProcess[str]:
    """Run `argv` to its end; one that does not end within `seconds` is killed: PocFailed."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=seconds,
                              check=False, **options)
    except subprocess.TimeoutExpired:
        raise PocFailed(f"`{' '.join(argv)}` did not finish within {seconds} s: {fix}") from None


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def _start(service: Service) -> None:
    if service.key == "redis":
        argv = redis_argv(service.port, _redis_data(service))
        env = child_environment()
    else:
        argv = ["rabbitmq-server", "-detached"]
        env = child_environment({"RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                                 "ERL_EPMD_ADDRESS": "127.0.0.1",
                                 "RABBITMQ_NODE_PORT": str(service.port)})
    fix = f"start it yourself, e.g. {_yourself(service)}, {_or_elsewhere(service)}"
    done = _run(argv, 60, fix, env=env, start_new_session=True)
    if done.returncode != 0:
        raise PocFailed(f"{service.title} did not start ({' '.join(argv[:2])}: "
                        f"{_last_line(done)}): {fix}")


def _yourself(service: Service) -> str:
    if service.key == "redis":
        return "`redis-server --daemonize yes --appendonly yes --appendfsync everysec`"
    return "`sudo rabbitmq-server -detached`"


def _redis_data(service: Service) -> Path:
    """The data folder of a Redis fedhive starts, made (private: it holds job records)."""
    data = redis_dir(service.port)
    fix = f"make it writable by this user, or start Redis yourself, e.g. {_yourself(service)}"
    try:
        data.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as err:
        raise PocFailed(f"cannot make Redis's data folder {data} ({err.strerror}): "
                        f"{fix}") from None
    if not os.access(data, os.W_OK | os.X_OK):
        raise PocFailed(f"Redis's data folder {data} is not writable: {fix}")
    return data


def _wait(service: Service, seconds: float) -> None:
    log = redis_dir(service.port) / "redis.log" if service.key == "redis" else "its log"
    deadline = time.monotonic() + seconds
    while not answers(service.host, service.port):
        if time.monotonic() > deadline:
            raise PocFailed(f"{service.title} did not answer on 127.0.0.1:{service.port} within "
                            f"{seconds:.0f} s of starting: see {log}, or start it yourself, "
                            f"e.g. {_yourself(service)}")
        time.sleep(0.2)


def _await_redis(url: str, seconds: float) -> None:
    """Until Redis answers PING: done loading its data."""
    import redis

    deadline = time.monotonic() + seconds
    client = redis.Redis.from_url(url, socket_timeout=3, socket_connect_timeout=3)
    try:
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.RedisError as err:  # BusyLoadingError among them
                if time.monotonic() > deadline:
                    raise PocFailed(f"Redis did not finish starting within {seconds:.0f} s: "
                                    f"{err}") from None
                time.sleep(0.2)
    finally:
        client.close()


def stop(keys: list[str], settings: Settings) -> None:
    """Stop the local RabbitMQ / Redis a POC start started (`poc stop --infra`)."""
    for service in services(settings):
        if service.key not in keys or not answers(service.host, service.port):
            continue
        if service.key == "redis":
            import redis

            client = redis.Redis.from_url(settings.redis_url)
            with contextlib.suppress(redis.RedisError):
                client.shutdown(nosave=True)  # the connection closes: an error, but done
            client.close()
        else:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(["rabbitmqctl", "shutdown"], capture_output=True, timeout=120,
                               check=False)
