"""Create (or delete) the RabbitMQ users of a fedhive deployment: one per site, one for services.

    python deploy/broker_users.py create site-1 site-2 --credentials secrets/broker.json
    python deploy/broker_users.py create --sites-file sites.txt --credentials secrets/broker.json
    python deploy/broker_users.py delete fedhive.site-1 fedhive.site-2 fedhive-services

Namespace and vhost default to FEDHIVE_NAMESPACE and the vhost of FEDHIVE_AMQP_URL. Every user
gets a fresh random password (re-running `create` rotates them); the passwords go only to the
`--credentials` JSON file ({"user": "password"}), written with mode 0600 — never commit it.
A site's user may configure nothing on the broker: `create` also declares the site's control
queue `<namespace>.site.<site>` (an existing one is left as it is) and `delete` deletes it.

The users, their permissions (and why each grant) and the one `rabbitmqctl eval` that creates
them are in `fedhive.brokerusers`; this script is its command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from fedhive.brokerusers import (
    BrokerUser,
    Permissions,
    check_name,
    check_user,
    create_users,
    definitions,
    delete_users,
    new_password,
    password_hash,
    plan,
    service_permissions,
    site_permissions,
    site_user,
    vhost_of,
    with_user,
    write_credentials,
)
from fedhive.config import Settings
from fedhive.errors import FedhiveError, InvalidArgument

__all__ = [  # what tests and benchmarks use through this script (tests/fixtures/sites.py)
    "BrokerUser", "Permissions", "check_name", "check_user", "create_users", "definitions",
    "delete_users", "main", "new_password", "password_hash", "plan", "service_permissions",
    "site_permissions", "site_user", "vhost_of", "with_user", "write_credentials",
]


def _sites(args: argparse.Namespace) -> list[str]:
    sites = list(args.users)
    if getattr(args, "sites_file", None):
        lines = Path(args.sites_file).read_text().splitlines()
        sites += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return [check_name(site) for site in dict.fromkeys(sites)]


def main(argv: Sequence[str] | None = None) -> int:
    settings = Settings.from_env()
    parser = argparse.ArgumentParser(prog="broker_users.py", description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", default=settings.namespace)
    parser.add_argument("--vhost", default=vhost_of(settings.amqp_url))
    parser.add_argument("--rabbitmqctl", default="rabbitmqctl",
                        help="command prefix, e.g. 'docker compose exec -T rabbitmq rabbitmqctl'")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="create/rotate site users and the services user")
    create.add_argument("users", nargs="*", metavar="SITE")
    create.add_argument("--sites-file", help="one site name per line")
    create.add_argument("--service-user", default=f"{settings.namespace}-services",
                        help="name of the services' user ('' for none; default %(default)s)")
    create.add_argument("--credentials", required=True, type=Path,
                        help="JSON file the passwords are written to (mode 0600)")
    delete = sub.add_parser("delete", help="delete users and their sites' control queues "
                                           "(missing ones are ignored)")
    delete.add_argument("users", nargs="+", metavar="USER")
    args = parser.parse_args(argv)
    ctl = shlex.split(args.rabbitmqctl)
    try:
        if args.command == "delete":
            delete_users([check_user(user) for user in dict.fromkeys(args.users)], ctl)
            print(f"deleted {len(args.users)} user(s)")
            return 0
        users = plan(args.namespace, _sites(args), args.service_user)
        if not users:
            raise InvalidArgument("no sites and no service user given", field="site")
        write_credentials(args.credentials, users)
        create_users(users, args.vhost, ctl, namespace=args.namespace)
    except (FedhiveError, OSError) as err:
        print(f"broker_users.py: {err}", file=sys.stderr)
        return 2
    for user in users:
        print(f"user {user.name} on vhost {args.vhost}: password in {args.credentials}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
