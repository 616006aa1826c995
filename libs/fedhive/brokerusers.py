"""The RabbitMQ users of a fedhive deployment: one per site, which reaches nothing but its own
work, and one for the services.

Used by `deploy/broker_users.py` (the command line), `deploy/compose/broker_setup.py` (the
management HTTP API) and `fedhive poc`.

A site's user is named `<namespace>.<site>` (`Names.site_user`): two deployments, or tenants,
sharing a broker never share a user. What it runs: ONE `rabbitmqctl eval` reading
`rabbit_definitions:import_raw(<<"JSON">>).` on stdin, JSON being a definitions document (the
namespace's exchanges, users with salted SHA-256 password hashes, permissions, topic
permissions): no password or hash appears on a command line, 1,000 sites take one call instead
of 4,000, and it returns when the import is done (`rabbitmqctl import_definitions -` takes the
same document but returns before). The equivalent, per site S in namespace N on vhost V
(regexes anchored; `N`, `S` regex-escaped):

    rabbitmqctl add_user N.S <password>
    rabbitmqctl set_permissions -p V N.S \\
        '^N\\.site\\.S$' \\                                              # configure
        '^(N\\.site\\.S|N\\.(cmd|events|replies))$' \\                   # write
        '^(N\\.site\\.S|N\\.cmd|amq\\.rabbitmq\\.reply-to)$'            # read
    rabbitmqctl set_topic_permissions -p V N.S N.events '^site\\.S\\.' '^$'
    rabbitmqctl set_topic_permissions -p V N.S N.cmd \\
        '^N\\.job\\.[^.]+\\.server\\.S$' '^N\\.site\\.S$'
    rabbitmqctl set_topic_permissions -p V N.S N.replies '^N\\.reply\\.' '^$'

and for the services user U:

    rabbitmqctl set_permissions -p V U '^(N\\.|amq\\.)' '^(N\\.|amq\\.)' '^(N\\.|amq\\.)'

(everything under the namespace, the default exchange and direct reply-to; no topic limits).
`delete_users` runs one `rabbitmqctl eval` deleting the listed users.

What a site's connection does, and the grant each needs (`fedhive.bus`, site mode):
* declare its control queue `N.site.S` (configure on it; no dead-letter queue, so it needs
  nothing on `N.dlx`) and bind it to `N.cmd` by its own name (write on the queue, read on
  `N.cmd` limited by the topic read permission to that one key), consume it (read);
* check the exchanges passively (no permission needed): it may declare, and so delete, none;
* publish task traffic to `N.cmd` only with the routing key `N.job.<job>.server.S`, which the
  server job of a job binds for each of the job's sites and nothing else binds: a site reaches
  the server jobs of its own jobs only (any other key is refused or unroutable);
* publish events to `N.events` only under `site.S.` (heartbeats, online, offline, job beats;
  never `site.online`/`site.offline`, which only the registry publishes, nor `job.status.*`);
* answer the services' RPC requests through `N.replies` (routing keys `N.reply.*`: the
  services' reply queues only; nothing else is bound there), and read replies to its own calls
  through direct reply-to (the services answer it through the default exchange).
It has no write on the default exchange (`amq.default`), which would let it publish to any
queue by name. Every consumer checks the verified `user_id` of what it takes besides
(`fedhive.bus.senders`).
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

from fedhive.bus.topology import Topology
from fedhive.errors import ConfigError, FedhiveError, InvalidArgument
from fedhive.names import Names

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # no dots: a site name is one routing-key word
_USER = re.compile(r"^[A-Za-z0-9_-]{1,64}(\.[A-Za-z0-9_-]{1,64})?$")  # a site's: <ns>.<site>


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
    """A site's (or the services user's) name."""
    if not _NAME.match(name):
        raise InvalidArgument(f"user/site name {name!r} must be 1-64 chars of A-Z, a-z, 0-9, "
                              f"'_' or '-'", field="site")
    return name


def check_user(name: str) -> str:
    """A broker user's name: a site's (`<namespace>.<site>`) or the services user's."""
    if not _USER.match(name):
        raise InvalidArgument(f"broker user {name!r} must be a site's user (<namespace>.<site>) "
                              "or a name of 1-64 chars of A-Z, a-z, 0-9, '_' or '-'",
                              field="user")
    return name


def site_permissions(namespace: str, site: str) -> Permissions:
    n, s = re.escape(namespace), re.escape(check_name(site))
    own = rf"{n}\.site\.{s}"
    return Permissions(
        configure=rf"^{own}$",
        write=rf"^({own}|{n}\.(cmd|events|replies))$",
        read=rf"^({own}|{n}\.cmd|amq\.rabbitmq\.reply-to)$",
        topics={
            f"{namespace}.events": (rf"^site\.{s}\.", "^$"),
            f"{namespace}.cmd": (rf"^{n}\.job\.[^.]+\.server\.{s}$", rf"^{own}$"),
            f"{namespace}.replies": (rf"^{n}\.reply\.", "^$"),
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


def definitions(users: Iterable[BrokerUser], vhost: str, namespace: str | None,
                ) -> dict[str, Any]:
    """The `import_definitions` document that creates the namespace's exchanges (a site's
    connection only checks them: `fedhive.bus.topology`; none for `namespace` None) and `users`
    with their permissions."""
    users = list(users)
    exchanges = Topology(Names(namespace)).exchanges() if namespace else []
    return {
        "vhosts": [{"name": vhost}],
        "exchanges": [
            {"name": name, "vhost": vhost, "type": kind, "durable": True, "auto_delete": False,
             "internal": False, "arguments": {}}
            for name, kind in exchanges
        ],
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


def create_users(users: Sequence[BrokerUser], vhost: str, ctl: Sequence[str], *,
                 namespace: str | None) -> None:
    """Import `definitions(users, vhost, namespace)` synchronously (`rabbitmqctl
    import_definitions -` returns before the import is done), by an expression `rabbitmqctl
    eval` reads from stdin."""
    document = json.dumps(definitions(users, vhost, namespace))
    document = document.replace("\\", "\\\\").replace('"', '\\"')
    answer = _ctl(ctl, ["eval"], f'rabbit_definitions:import_raw(<<"{document}">>).')
    if answer.strip() != "ok":
        raise FedhiveError(f"importing broker users failed: {' '.join(answer.split())}")


def delete_users(names: Sequence[str], ctl: Sequence[str]) -> None:
    quoted = ", ".join(f'<<"{check_user(name)}">>' for name in names)
    code = (f"[rabbit_auth_backend_internal:delete_user(U, <<\"fedhive\">>) || U <- [{quoted}],"
            " rabbit_auth_backend_internal:exists(U)], ok.")
    _ctl(ctl, ["eval", code])


def plan(namespace: str, sites: Sequence[str], service_user: str | None) -> list[BrokerUser]:
    """One user per site (`Names.site_user`) and, when named, the services user."""
    users = [BrokerUser(Names(namespace).site_user(site), new_password(),
                        site_permissions(namespace, site)) for site in sites]
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


def user_of(amqp_url: str) -> str:
    """The broker user an AMQP URL names ("guest" by default)."""
    return str(pika.URLParameters(amqp_url).credentials.username)


def with_user(amqp_url: str, user: str, password: str) -> str:
    """`amqp_url` with another user's credentials (scheme, host, port and vhost kept)."""
    params = pika.URLParameters(amqp_url)
    vhost = quote(params.virtual_host, safe="")
    scheme = "amqps" if amqp_url.startswith("amqps://") else "amqp"
    return (f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{params.host}:"
            f"{params.port}/{vhost}")
