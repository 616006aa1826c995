"""The RabbitMQ users of a fedhive deployment: one per site, which reaches nothing but its own
work, and one for the services.

Used by `deploy/broker_users.py` (the command line), `deploy/compose/broker_setup.py` (the
management HTTP API) and `fedhive poc`.

A site's user is named `<namespace>.<site>` (`Names.site_user`): two deployments, or tenants,
sharing a broker never share a user. It may configure nothing: the provisioning declares what
its connection uses (the namespace's exchanges, the site's control queue and its binding), and
the site only checks them passively. What it runs: ONE `rabbitmqctl eval` reading
`rabbit_definitions:import_raw(<<"JSON">>).` on stdin, JSON being a definitions document (the
namespace's exchanges, the sites' control queues and bindings, users with salted SHA-256
password hashes, permissions, topic permissions): no password or hash appears on a command
line, 1,000 sites take one call instead of 7,000, and it returns when the import is done
(`rabbitmqctl import_definitions -` takes the same document but returns before). Importing it
again (new passwords, a site added) leaves existing exchanges, queues and bindings as they are;
the same eval then closes the imported users' open connections (`rabbitmqctl
close_all_user_connections N.S`): a new password must end the old one's sessions.
The equivalent, per site S in namespace N on vhost V (regexes anchored; `N`, `S`
regex-escaped; the queue as `Topology(site=True)` describes it: quorum, delivery limit, no
dead letters):

    rabbitmqadmin -V V declare queue name=N.site.S durable=true \\
        arguments='{"x-queue-type": "quorum", "x-delivery-limit": 5}'
    rabbitmqadmin -V V declare binding source=N.cmd destination=N.site.S \\
        routing_key=N.site.S
    rabbitmqctl add_user N.S <password>
    rabbitmqctl set_permissions -p V N.S \\
        '^$' \\                                         # configure
        '^N\\.(cmd|events|replies)$' \\                 # write
        '^(N\\.site\\.S|amq\\.rabbitmq\\.reply-to)$'    # read
    rabbitmqctl set_topic_permissions -p V N.S N.events '^site\\.S\\.' '^$'
    rabbitmqctl set_topic_permissions -p V N.S N.cmd '^N\\.job\\.[^.]+\\.server\\.S$' '^$'
    rabbitmqctl set_topic_permissions -p V N.S N.replies '^N\\.reply\\.' '^$'

and for the services user U:

    rabbitmqctl set_permissions -p V U '^(N\\.|amq\\.)' '^(N\\.|amq\\.)' '^(N\\.|amq\\.)'

(everything under the namespace, the default exchange and direct reply-to; no topic limits).
`delete_users` runs one `rabbitmqctl eval` deleting the listed users and the sites' control
queues (`rabbitmqctl delete_queue -p V N.site.S; rabbitmqctl delete_user N.S`).

What a site's connection does, and the grant each needs (`fedhive.bus`, site mode):
* check the exchanges and its control queue passively (no permission needed): it declares,
  binds, and so deletes or unbinds, nothing; not even a server-named or exclusive queue
  (it takes replies to its own calls through direct reply-to, which needs no declaration);
* consume its control queue (read on it);
* publish task traffic to `N.cmd` only with the routing key `N.job.<job>.server.S`, which the
  server job of a job binds for each of the job's sites and nothing else binds: a site reaches
  the server jobs of its own jobs only (any other key is refused or unroutable);
* publish events to `N.events` only under `site.S.` (heartbeats, online, offline, job beats;
  never `site.online`/`site.offline`, which only the registry publishes, nor `job.status.*`);
* answer the services' RPC requests through `N.replies` (routing keys `N.reply.*`: the
  services' reply queues only; nothing else is bound there), and read replies to its own calls
  through direct reply-to (read on `amq.rabbitmq.reply-to`; the services answer it through
  the default exchange).
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
    site: str | None = None  # a site's user: its control queue is declared with it


def site_user(namespace: str, site: str, password: str | None = None) -> BrokerUser:
    """A site's user (`Names.site_user`), with a fresh password unless one is given."""
    return BrokerUser(Names(namespace).site_user(check_name(site)), password or new_password(),
                      site_permissions(namespace, site), site=site)


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
    return Permissions(
        configure="^$",
        write=rf"^{n}\.(cmd|events|replies)$",
        read=rf"^({n}\.site\.{s}|amq\.rabbitmq\.reply-to)$",
        topics={
            f"{namespace}.events": (rf"^site\.{s}\.", "^$"),
            f"{namespace}.cmd": (rf"^{n}\.job\.[^.]+\.server\.{s}$", "^$"),
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
    """The `import_definitions` document that creates the namespace's exchanges (none for
    `namespace` None), `users` with their permissions and each site's control queue, bound to
    the command exchange by its own name (what its `Topology(site=True)` would have declared:
    a site's connection only checks them, `fedhive.bus.topology`). Importing it again changes
    passwords and permissions and leaves existing exchanges, queues and bindings as they are."""
    users = list(users)
    sites = [u.site for u in users if u.site]
    if sites and namespace is None:
        raise ValueError("site users need the namespace of their queues")
    topology = Topology(Names(namespace or ""), site=True)
    specs = [topology.command_queue(topology.names.site_queue(site)) for site in sites]
    return {
        "vhosts": [{"name": vhost}],
        "exchanges": [
            {"name": name, "vhost": vhost, "type": kind, "durable": True, "auto_delete": False,
             "internal": False, "arguments": {}}
            for name, kind in (topology.exchanges() if namespace else [])
        ],
        "queues": [
            {"name": spec.name, "vhost": vhost, "durable": True, "auto_delete": False,
             "arguments": topology.queue_arguments(spec)}
            for spec in specs
        ],
        "bindings": [
            {"source": spec.exchange, "vhost": vhost, "destination": spec.name,
             "destination_type": "queue", "routing_key": key, "arguments": {}}
            for spec in specs
            for key in spec.binding_keys
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


# What `rabbitmqctl eval` says when it read nothing from stdin: seen once in ~2,000 calls on a
# loaded machine although the expression was written; nothing was evaluated, so it is retried.
_STDIN_UNREAD = "not provided via argument or stdin"


def _ctl(ctl: Sequence[str], args: Sequence[str], stdin: str | None = None) -> str:
    for _ in range(3):
        try:
            done = subprocess.run([*ctl, *args], input=stdin, capture_output=True, text=True,
                                  timeout=120, check=False)
        except FileNotFoundError:
            raise ConfigError(f"{ctl[0]} not found (RabbitMQ's command-line tools manage "
                              "broker users)", field="rabbitmqctl") from None
        if stdin is None or _STDIN_UNREAD not in done.stderr + done.stdout:
            break
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise FedhiveError(f"{' '.join(ctl)} {args[0]} failed: {reason[-1] if reason else '?'}")
    return done.stdout


def create_users(users: Sequence[BrokerUser], vhost: str, ctl: Sequence[str], *,
                 namespace: str | None) -> None:
    """Import `definitions(users, vhost, namespace)` synchronously (`rabbitmqctl
    import_definitions -` returns before the import is done), by an expression `rabbitmqctl
    eval` reads from stdin; then close the users' open connections. RabbitMQ checks a password
    only when a connection opens: without that, a rotated (leaked) password's sessions would go
    on as they were. A site's agent reconnects once it has the new password."""
    document = json.dumps(definitions(users, vhost, namespace))
    document = document.replace("\\", "\\\\").replace('"', '\\"')
    names = ", ".join(f'<<"{check_user(user.name)}">>' for user in users)
    answer = _ctl(ctl, ["eval"], (
        f'case rabbit_definitions:import_raw(<<"{document}">>) of'
        f" ok -> Users = [{names}],"
        " [rabbit_networking:close_connection(C, \"its password was changed\")"
        " || C <- rabbit_networking:connections(),"
        " {user, U} <- case catch rabbit_networking:connection_info(C, [user]) of"
        " [{user, _} = Info] -> [Info]; _ -> [] end,"  # one closing meanwhile: none
        " lists:member(U, Users)], ok;"
        " Failed -> Failed end."))
    if answer.strip() != "ok":
        raise FedhiveError(f"importing broker users failed: {' '.join(answer.split())}")


def delete_users(names: Sequence[str], ctl: Sequence[str]) -> None:
    """Delete the users (missing ones are ignored) and a site user's control queue on every
    vhost it had permissions on: nothing consumes it any more, and sending to a site that was
    removed should fail as unroutable rather than pile up in its queue."""
    pairs = []
    for name in names:
        namespace, dot, site = check_user(name).partition(".")  # a site's: <namespace>.<site>
        queue = Names(namespace).site_queue(site) if dot else ""
        pairs.append(f'{{<<"{name}">>, <<"{queue}">>}}')
    code = (
        "Delete = fun(U, Q) -> "
        "[case rabbit_amqqueue:lookup(rabbit_misc:r(proplists:get_value(vhost, P), queue, Q)) of"
        " {ok, Found} -> rabbit_amqqueue:delete(Found, false, false, <<\"fedhive\">>);"
        " _ -> ok end"
        " || Q =/= <<>>, P <- rabbit_auth_backend_internal:list_user_permissions(U)],"
        " rabbit_auth_backend_internal:delete_user(U, <<\"fedhive\">>) end,"
        f" [Delete(U, Q) || {{U, Q}} <- [{', '.join(pairs)}],"
        " rabbit_auth_backend_internal:exists(U)], ok.")
    _ctl(ctl, ["eval", code])


def plan(namespace: str, sites: Sequence[str], service_user: str | None) -> list[BrokerUser]:
    """One user per site (`Names.site_user`) and, when named, the services user."""
    users = [site_user(namespace, site) for site in sites]
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
