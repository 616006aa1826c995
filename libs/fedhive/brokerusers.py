"""Per-site RabbitMQ users of a fedhive deployment: one per site (it may read only its own
control queue and publish only its own events) and one for the services.

Used by `deploy/broker_users.py` (the command line) and `fedhive poc`.

What it runs: ONE `rabbitmqctl eval` reading `rabbit_definitions:import_raw(<<"JSON">>).` on
stdin, JSON being a definitions document (users with salted SHA-256 password hashes,
permissions, topic permissions): no password or hash appears on a command line, 1,000 sites
take one call instead of 4,000, and it returns when the import is done (`rabbitmqctl
import_definitions -` takes the same document but returns before). The equivalent, per site
S in namespace N on vhost V (regexes anchored; `N`, `S` regex-escaped):

    rabbitmqctl add_user S <password>
    rabbitmqctl set_permissions -p V S \\
        '^(N\\.site\\.S(\\.dlq)?|N\\.(cmd|events|dlx))$' \\                        # configure
        '^(N\\.site\\.S(\\.dlq)?|N\\.(cmd|events|dlx)|amq\\.default)$' \\          # write
        '^(N\\.site\\.S(\\.dlq)?|N\\.(cmd|dlx)|amq\\.rabbitmq\\.reply-to)$'        # read
    rabbitmqctl set_topic_permissions -p V S N.events '^site\\.S\\.' '^$'
    rabbitmqctl set_topic_permissions -p V S N.cmd '^N\\.job\\.[^.]+\\.server$' '^N\\.site\\.S$'

and for the services user U:

    rabbitmqctl set_permissions -p V U '^(N\\.|amq\\.)' '^(N\\.|amq\\.)' '^(N\\.|amq\\.)'

(everything under the namespace, the default exchange and direct reply-to; no topic limits).
`delete_users` runs one `rabbitmqctl eval` deleting the listed users.

Why each grant (what fedhive.bus does on a site's connection):
* configure on its queue, its dead-letter queue and the three exchanges: the bus (re)declares
  them at every connect (same arguments, so nothing changes); nothing else can be declared.
* write on its queues (to bind them), on `N.cmd` (task traffic, limited by the topic permission
  to `N.job.<job>.server`), on `N.events` (limited to routing keys `site.S.*`: heartbeats,
  online, offline, job beats — never `site.online`/`site.offline`, which only the registry
  publishes), on `N.dlx` (RabbitMQ requires it to declare a queue that dead-letters there), and
  on `amq.default` (RPC replies go to the caller's direct reply-to through it).
* read on its own queues only (consume), on `N.cmd` and `N.dlx` (to bind its queues; the topic
  read permission allows binding only `N.site.S`) and on direct reply-to (its own RPC calls).

Known limits of what RabbitMQ permissions can express, given that the bus declares its own
topology: `amq.default` write lets a site publish to any queue by name (services must, as the
heartbeat intake does, check the `user_id` every site message carries, which RabbitMQ verifies);
configure on the shared exchanges would let a site delete them; read on `N.dlx` (a direct
exchange, where topic permissions do not apply) would let a site bind its own dead-letter queue
to another queue's dead letters. Declaring site topology passively (pre-created by this script
as the services user) would remove the last two grants; see the report to the lead.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import secrets
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika

from fedhive.errors import ConfigError, FedhiveError, InvalidArgument

_USER = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # no dots: a site name is one routing-key word


@dataclass(frozen=True)
class Permissions:
    configure: str
    write: str
    read: str
    topics: dict[str, tuple[str, str]] = field(default_factory=dict)  # exchange: (write, read)


@dataclass(frozen=True)
class BrokerUser:
    name: str
    password: str = field(repr=False)
    permissions: Permissions
    tags: tuple[str, ...] = ()


def check_name(name: str) -> str:
    if not _USER.match(name):
        raise InvalidArgument(f"user/site name {name!r} must be 1-64 chars of A-Z, a-z, 0-9, "
                              f"'_' or '-'", field="site")
    return name


def site_permissions(namespace: str, site: str) -> Permissions:
    n, s = re.escape(namespace), re.escape(check_name(site))
    own = rf"{n}\.site\.{s}(\.dlq)?"
    return Permissions(
        configure=rf"^({own}|{n}\.(cmd|events|dlx))$",
        write=rf"^({own}|{n}\.(cmd|events|dlx)|amq\.default)$",
        read=rf"^({own}|{n}\.(cmd|dlx)|amq\.rabbitmq\.reply-to)$",
        topics={
            f"{namespace}.events": (rf"^site\.{s}\.", "^$"),
            f"{namespace}.cmd": (rf"^{n}\.job\.[^.]+\.server$", rf"^{n}\.site\.{s}$"),
        },
    )


def service_permissions(namespace: str) -> Permissions:
    everything = rf"^({re.escape(namespace)}\.|amq\.)"
    return Permissions(everything, everything, everything)


def new_password() -> str:
    return secrets.token_urlsafe(24)


def password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's `rabbit_password_hashing_sha256`: base64(salt + sha256(salt + password))."""
    salt = secrets.token_bytes(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def definitions(users: Iterable[BrokerUser], vhost: str) -> dict[str, Any]:
    """The `import_definitions` document that creates `users` with their permissions."""
    users = list(users)
    return {
        "vhosts": [{"name": vhost}],
        "users": [
            {"name": u.name, "password_hash": password_hash(u.password),
             "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": list(u.tags)}
            for u in users
        ],
        "permissions": [
            {"user": u.name, "vhost": vhost, "configure": u.permissions.configure,
             "write": u.permissions.write, "read": u.permissions.read}
            for u in users
        ],
        "topic_permissions": [
            {"user": u.name, "vhost": vhost, "exchange": exchange, "write": write, "read": read}
            for u in users
            for exchange, (write, read) in u.permissions.topics.items()
        ],
    }


def _ctl(ctl: Sequence[str], args: Sequence[str], stdin: str | None = None) -> str:
    try:
        done = subprocess.run([*ctl, *args], input=stdin, capture_output=True, text=True,
                              timeout=120, check=False)
    except FileNotFoundError:
        raise ConfigError(f"{ctl[0]} not found (RabbitMQ's command-line tools manage broker "
                          "users)", field="rabbitmqctl") from None
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise FedhiveError(f"{' '.join(ctl)} {args[0]} failed: {reason[-1] if reason else '?'}")
    return done.stdout


def create_users(users: Sequence[BrokerUser], vhost: str, ctl: Sequence[str]) -> None:
    """Import `definitions(users)` synchronously (`rabbitmqctl import_definitions -` returns
    before the import is done), by an expression `rabbitmqctl eval` reads from stdin."""
    document = json.dumps(definitions(users, vhost)).replace("\\", "\\\\").replace('"', '\\"')
    answer = _ctl(ctl, ["eval"], f'rabbit_definitions:import_raw(<<"{document}">>).')
    if answer.strip() != "ok":
        raise FedhiveError(f"importing broker users failed: {' '.join(answer.split())}")


def delete_users(names: Sequence[str], ctl: Sequence[str]) -> None:
    quoted = ", ".join(f'<<"{check_name(name)}">>' for name in names)
    code = (f"[rabbit_auth_backend_internal:delete_user(U, <<\"fedhive\">>) || U <- [{quoted}],"
            " rabbit_auth_backend_internal:exists(U)], ok.")
    _ctl(ctl, ["eval", code])


def plan(namespace: str, sites: Sequence[str], service_user: str | None) -> list[BrokerUser]:
    users = [BrokerUser(site, new_password(), site_permissions(namespace, site))
             for site in sites]
    if service_user:
        users.append(BrokerUser(check_name(service_user), new_password(),
                                service_permissions(namespace)))
    return users


def write_credentials(path: Path, users: Sequence[BrokerUser]) -> None:
    """{"user": "password"} as JSON, created (or truncated) with mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({u.name: u.password for u in users}, out, indent=2)
        out.write("\n")


def vhost_of(amqp_url: str) -> str:
    """The virtual host an AMQP URL names ("/" by default)."""
    return str(pika.URLParameters(amqp_url).virtual_host)


def with_user(amqp_url: str, user: str, password: str) -> str:
    """`amqp_url` with another user's credentials (scheme, host, port and vhost kept)."""
    params = pika.URLParameters(amqp_url)
    vhost = quote(params.virtual_host, safe="")
    scheme = "amqps" if amqp_url.startswith("amqps://") else "amqp"
    return (f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{params.host}:"
            f"{params.port}/{vhost}")
