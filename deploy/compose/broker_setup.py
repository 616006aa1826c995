"""Create the broker users of a fedhive deployment through the RabbitMQ management HTTP API and
write each site's folder (docker-compose.yml's one-shot `broker-users` service runs it).

    python broker_setup.py --management-url http://rabbitmq:15672 --sites-root DIR SITE...

* The services' user (`--service-user`, default fedhive-services) gets the password in
  RABBITMQ_SERVICES_PASSWORD: the compose file builds the services' FEDHIVE_AMQP_URL from the
  same variable.
* Each SITE gets a user `<namespace>.<site>` with a random password, kept in
  `DIR/SITE/local/site.json`: a re-run keeps it, so an agent that is running stays valid. The
  user may configure nothing: the same import declares the site's control queue
  `<namespace>.site.<site>` and binds it (a re-run leaves an existing queue as it is).
* `DIR/SITE/local/site.json` gets the site, its broker URL (FEDHIVE_AMQP_URL's host, port and
  vhost with the site's user), FEDHIVE_NAMESPACE, the services' user (whose commands the agent
  takes) and `--storage-url` (where its app bundles come from); fields an operator added are
  kept.
  `local/resources.json` is copied from `--resources` when the site has none (and checked as
  the agent will load it); the folder is handed to `--owner` when this runs as root (named
  volumes start out owned by root).

Users and permissions are `fedhive.brokerusers`' (deploy/broker_users.py imports the same
definitions with `rabbitmqctl`; this needs no rabbitmqctl, so it works from another container
and against a managed broker's HTTPS management endpoint). The management API's account is
RABBITMQ_USER / RABBITMQ_PASSWORD (an administrator).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pwd
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pika

from fedhive.brokerusers import (
    BrokerUser,
    check_name,
    definitions,
    service_permissions,
    site_user,
    vhost_of,
    with_user,
)
from fedhive.config import Settings
from fedhive.errors import ConfigError, FedhiveError, InvalidArgument
from fedhive.jobs.validation import site_name_problem
from fedhive.names import Names
from fedhive.poc.layout import write_private
from fedhive.resources import load_resources

# A site folder as the site agent reads it (services/site_agent/config.py).
SITE_FILE = "local/site.json"
RESOURCES_FILE = "local/resources.json"
RETRY_S = 1.0


def _required_env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set", field=name)
    return value


def _url_safe(name: str, value: str) -> str:
    """A password the compose file puts into a URL as it is must need no escaping there."""
    if quote(value, safe="") != value:
        raise ConfigError(f"{name} must be URL-safe (letters, digits, '-', '_', '.', '~')",
                          field=name)
    return value


def import_definitions(management_url: str, user: str, password: str, document: dict[str, Any],
                       wait_s: float) -> None:
    """POST the definitions (merged into the broker's: existing users are updated, existing
    exchanges, queues and bindings left as they are); retries while the management API does
    not answer yet, up to `wait_s`."""
    request = urllib.request.Request(
        f"{management_url.rstrip('/')}/api/definitions", method="POST",
        data=json.dumps(document).encode(),
        headers={"content-type": "application/json",
                 "authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode())
                 .decode()})
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with urllib.request.urlopen(request, timeout=30):
                return
        except urllib.error.HTTPError as err:
            reason = err.read(500).decode(errors="replace").strip()
            if err.code in (401, 403):
                raise ConfigError(f"the management API refused RABBITMQ_USER {user!r} "
                                  f"(HTTP {err.code}): it must be an administrator with this "
                                  "password", field="RABBITMQ_USER") from None
            if err.code < 500 or time.monotonic() > deadline:
                raise FedhiveError(f"importing broker users at {management_url} failed: HTTP "
                                   f"{err.code} {reason}") from None
        except OSError as err:  # not listening yet
            if time.monotonic() > deadline:
                raise FedhiveError(f"the RabbitMQ management API at {management_url} did not "
                                   f"answer within {wait_s:.0f} s: {err}") from None
        time.sleep(RETRY_S)


def _earlier_password(site_dir: Path, user: str) -> str | None:
    """The site's password from its site.json, when it holds one for this user."""
    try:
        params = pika.URLParameters(json.loads((site_dir / SITE_FILE).read_text())["broker_url"])
    except (OSError, ValueError, LookupError, TypeError):
        return None
    credentials = params.credentials
    username = getattr(credentials, "username", None)
    password = getattr(credentials, "password", None)
    return str(password) if username == user and password else None


def write_site(site_dir: Path, site: str, broker_url: str, link: dict[str, str],
               resources: Path) -> None:
    """`link`: namespace, services_user and storage_url, as site.json names them."""
    config_file = site_dir / SITE_FILE
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    config.setdefault("org", site)
    config.update(site=site, broker_url=broker_url, **link)
    write_private(config_file, json.dumps(config, indent=2) + "\n")
    if not (site_dir / RESOURCES_FILE).exists():
        shutil.copyfile(resources, site_dir / RESOURCES_FILE)
    load_resources(site_dir / RESOURCES_FILE)  # as the agent will: a bad file fails here


def hand_over(site_dir: Path, owner: str) -> None:
    """Give the site folder and what this wrote in it to `owner` (when running as root;
    otherwise they are ours already); the agent creates its workspace itself."""
    if os.geteuid() != 0:
        return
    account = pwd.getpwnam(owner)
    for path in (site_dir, site_dir / "local", site_dir / SITE_FILE, site_dir / RESOURCES_FILE):
        os.chown(path, account.pw_uid, account.pw_gid, follow_symlinks=False)


def _site_name(name: str) -> str:
    """A broker user name that is also a valid site name (the agent's checks)."""
    problem = site_name_problem(check_name(name))
    if problem is not None:
        raise InvalidArgument(f"site {name!r}: {problem}", field="site")
    return name


def setup(args: argparse.Namespace) -> list[str]:
    settings = Settings.from_env()
    sites = [_site_name(site) for site in dict.fromkeys(args.sites)]
    users = [BrokerUser(check_name(args.service_user),
                        _url_safe("RABBITMQ_SERVICES_PASSWORD",
                                  _required_env("RABBITMQ_SERVICES_PASSWORD")),
                        service_permissions(settings.namespace))]
    names = Names(settings.namespace)
    users += [site_user(settings.namespace, site,
                        _earlier_password(args.sites_root / site, names.site_user(site)))
              for site in sites]
    vhost = vhost_of(settings.amqp_url)
    import_definitions(args.management_url, _required_env("RABBITMQ_USER"),
                       _required_env("RABBITMQ_PASSWORD"),
                       definitions(users, vhost, settings.namespace), args.wait)
    link = {"namespace": settings.namespace, "services_user": args.service_user,
            "storage_url": args.storage_url}
    for site, user in zip(sites, users[1:], strict=True):
        site_dir = args.sites_root / site
        write_site(site_dir, site, with_user(settings.amqp_url, user.name, user.password),
                   link, args.resources)
        hand_over(site_dir, args.owner)
    return [f"user {user.name} on vhost {vhost}" for user in users]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="broker_setup.py", description=__doc__.splitlines()[0])
    parser.add_argument("sites", nargs="+", metavar="SITE")
    parser.add_argument("--management-url", required=True,
                        help="the RabbitMQ management API, e.g. http://rabbitmq:15672")
    parser.add_argument("--sites-root", type=Path, required=True,
                        help="the folder holding one folder per site")
    parser.add_argument("--service-user", default="fedhive-services")
    parser.add_argument("--storage-url", required=True,
                        help="the object store as the sites reach it, e.g. "
                        "http://minio:9000/fedhive: app bundles come from under it only")
    parser.add_argument("--resources", type=Path,
                        default=Path(__file__).resolve().parent / "resources.json",
                        help="resources.json for a site that has none (default %(default)s)")
    parser.add_argument("--owner", default="fedhive",
                        help="account the site folders go to when run as root")
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds to wait for the management API (default %(default)s)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        done = setup(args)
    except (FedhiveError, OSError, KeyError) as err:
        print(f"broker_setup.py: {err}", file=sys.stderr)
        return 2
    for line in done:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
