"""Starting a POC: the whole system on this machine, as detached processes.

1. checks (nothing started yet): no POC running in the folder, disk space, the gateway's port,
   SeaweedFS when it is needed, else that the S3 server FEDHIVE_S3_ENDPOINT_URL names answers;
2. RabbitMQ and Redis answer (`infra.ensure`: started, or installed, when local);
3. the embedded S3 server (unless FEDHIVE_S3_ENDPOINT_URL is set), one broker user per site,
   the site folders, the admins file and the admin's CLI config;
4. job-store, scheduler, job-runner, gateway and the site agents; then it waits until each
   logged `service.started`, the gateway serves and lists every site online.

The state file is rewritten after every step. Whatever fails (or Ctrl-C) stops everything
started so far (`stop.teardown`, RabbitMQ and Redis included when this start started them) and
raises one line (`PocFailed`); a failure with the disk full names the disk, whatever failed
first (`checks.blame_the_disk`).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from fedhive.blobs import S3BlobStore
from fedhive.brokerusers import check_name, create_users, plan, user_of, vhost_of, with_user
from fedhive.config import Settings
from fedhive.errors import ConfigError, FedhiveError, InvalidArgument, PocFailed
from fedhive.poc import checks, infra, probes, procs
from fedhive.poc.layout import PocLayout, write_private
from fedhive.poc.s3server import (
    PORT_OPTIONS,
    S3Identity,
    read_identity,
    weed_argv,
    write_identity,
)
from fedhive.poc.services import SiteLink, admin_token, commands, environment, write_site
from fedhive.poc.state import PocState, ProcessEntry, load_state
from fedhive.poc.stop import shielded, teardown

Say = Callable[[str], None]
GATEWAY_HOST = "127.0.0.1"


@dataclass(frozen=True)
class PocOptions:
    root: Path | None = None  # None: ~/.fedhive/poc
    sites: int = 2
    site_prefix: str = "site-"  # sites are named <prefix>1 ... <prefix>N
    namespace: str = "poc"
    port: int = 50051  # the gateway's, on 127.0.0.1
    timeout: float = 90.0  # for each wait: S3 up, services started, sites online
    rabbitmqctl: tuple[str, ...] = ("rabbitmqctl",)
    # site -> {file under its local/ folder: content}, written before its agent starts (e.g. a
    # hub site's hub.json and token file: examples/hierarchy)
    site_files: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def site_names(self) -> list[str]:
        if self.sites < 1:
            raise InvalidArgument("--sites must be at least 1", field="sites")
        return [check_name(f"{self.site_prefix}{n}") for n in range(1, self.sites + 1)]


@dataclass(frozen=True)
class Started:
    state: PocState
    layout: PocLayout
    settings: Settings  # what the services run with
    token: str  # the POC admin's


def start_poc(options: PocOptions, settings: Settings, say: Say = lambda _: None) -> Started:
    layout = PocLayout.at(options.root)
    sites = options.site_names()
    try:
        settings = settings.with_namespace(options.namespace)
    except ConfigError:
        raise PocFailed(f"--namespace {options.namespace!r} must be 1-40 chars of a-z, 0-9, "
                        "'_' or '-'") from None
    with layout.locked():
        _no_poc_running(layout, settings, options)
        checks.disk_space(layout.root)
        checks.port_free(GATEWAY_HOST, options.port, "gateway", "--port")
        weed = checks.weed() if settings.s3_endpoint_url is None else None
        if settings.s3_endpoint_url is not None:
            checks.s3_answers(settings.s3_endpoint_url)
        state = PocState(
            root=str(layout.root), namespace=settings.namespace, sites=sites,
            gateway=f"{GATEWAY_HOST}:{options.port}",
            s3_endpoint=settings.s3_endpoint_url or "", embedded_s3=weed is not None,
            started_at=datetime.now(UTC).isoformat(timespec="seconds"))
        try:
            layout.make()
            infra.ensure(settings, say, started=state.infra_started)
            state.save(layout.state_file)
            if weed is not None:
                settings = _start_s3(weed, layout, state, settings, say)
            token = _prepare(layout, state, settings, options.rabbitmqctl, say)
            for site, files in options.site_files.items():
                for name, content in files.items():
                    write_private(layout.site_dir(site) / "local" / name, content)
            _wait_s3(state, options.timeout)
            _start_services(layout, state, settings, say)
            _wait_started(state, options, token, say)
            state.ready = True
            state.save(layout.state_file)
        except BaseException as err:
            with shielded():
                if state.processes or state.broker_users or state.infra_started:
                    with contextlib.suppress(Exception):  # e.g. stdout closed: clean up anyway
                        say("stopping what was started")
                teardown(state, layout, settings, options.rabbitmqctl, infra_too=True)
            if isinstance(err, Exception):  # not Ctrl-C
                checks.blame_the_disk(layout.root, err)
            raise
    return Started(state, layout, settings, token)


def _no_poc_running(layout: PocLayout, settings: Settings, options: PocOptions) -> None:
    earlier = load_state(layout.state_file)
    if earlier is None:
        procs.stop_marked(layout.root, grace=5.0)  # strays of a POC whose state was lost
        return
    if any(procs.alive(entry) for entry in earlier.processes):
        raise PocFailed(f"a POC is already running in {layout.root} (gateway {earlier.gateway}):"
                        f" use it, or stop it with `fedhive poc stop --dir {layout.root}`")
    teardown(earlier, layout, settings, options.rabbitmqctl)  # what a crashed one left


def _record(state: PocState, layout: PocLayout, entry: ProcessEntry) -> None:
    state.processes.append(entry)
    state.save(layout.state_file)


def _start_s3(weed: str, layout: PocLayout, state: PocState, settings: Settings,
              say: Say) -> Settings:
    config = layout.s3_dir / "s3.json"
    identity = read_identity(config)
    if identity is None:
        identity = S3Identity.new()
        write_identity(config, identity)
    argv, endpoint = weed_argv(weed, layout.s3_dir / "data", config)
    say(f"starting the embedded S3 server (SeaweedFS) at {endpoint}")
    env = environment(settings, layout)
    _record(state, layout, procs.spawn("seaweedfs", argv, env=env, log=layout.log("seaweedfs"),
                                       cwd=layout.s3_dir))
    state.s3_endpoint = endpoint
    state.save(layout.state_file)
    return replace(settings, s3_endpoint_url=endpoint, s3_public_endpoint_url=None,
                   aws_access_key_id=identity.access_key,
                   aws_secret_access_key=identity.secret_key, aws_session_token=None)


def _prepare(layout: PocLayout, state: PocState, settings: Settings, ctl: Sequence[str],
             say: Say) -> str:
    """Broker users (recorded first: a failure later deletes them), site folders, the admin."""
    say(f"creating broker users for {', '.join(state.sites)}")
    users = plan(settings.namespace, state.sites, None)
    state.broker_users = [user.name for user in users]
    state.save(layout.state_file)
    try:
        create_users(users, vhost_of(settings.amqp_url), ctl, namespace=settings.namespace)
    except ConfigError:
        raise PocFailed(f"{ctl[0]} not found (RabbitMQ's tools create the sites' broker users):"
                        f" {infra.install_hint('rabbitmq-server')}") from None
    except FedhiveError as err:
        raise PocFailed(f"cannot create the sites' broker users ({err}): run as a user who may "
                        "use rabbitmqctl, or pass --rabbitmqctl 'sudo rabbitmqctl'") from None
    except subprocess.TimeoutExpired as err:
        raise PocFailed(f"{ctl[0]} did not answer within {err.timeout:.0f} s (creating the sites'"
                        " broker users): check that RabbitMQ runs (rabbitmqctl status)") from None
    store = S3BlobStore.from_settings(settings)
    link = SiteLink(settings.namespace, user_of(settings.amqp_url), store.url_prefix(),
                    settings.amqp_ca_file)
    store.close()
    for site, user in zip(state.sites, users, strict=True):
        write_site(layout, site, with_user(settings.amqp_url, user.name, user.password), link)
    return admin_token(layout, state.gateway)


def _start_services(layout: PocLayout, state: PocState, settings: Settings, say: Say) -> None:
    found = commands(layout, state.sites, state.gateway)
    say(f"starting {', '.join(c.name for c in found)}")
    services_env = environment(settings, layout)
    sites_env = environment(settings, layout, site=True)
    for command in found:
        env = sites_env if command.name.startswith("site-") else services_env
        # Each process its own readiness file (two site agents would share the default path).
        env = {**env, "FEDHIVE_READY_FILE": str(layout.logs / f"{command.name}.ready")}
        command.cwd.mkdir(parents=True, exist_ok=True)
        _record(state, layout, procs.spawn(command.name, command.argv, env=env,
                                           log=layout.log(command.name), cwd=command.cwd))


def _wait_s3(state: PocState, timeout: float) -> None:
    if state.embedded_s3:
        _wait(state, lambda: probes.http_answers(state.s3_endpoint), timeout,
              f"the embedded S3 server to answer at {state.s3_endpoint}")


def _wait_started(state: PocState, options: PocOptions, token: str, say: Say) -> None:
    services = [e for e in state.processes if e.name != "seaweedfs"]
    say("waiting for the services to start")
    _wait(state, lambda: all(probes.logged_started(Path(e.log)) for e in services),
          options.timeout, "the services to start")
    _wait(state, lambda: probes.gateway_serving(state.gateway), options.timeout,
          f"the gateway to serve on {state.gateway}")
    say(f"waiting for {', '.join(state.sites)} to come online")
    _wait(state, lambda: set(state.sites) <= probes.online_sites(state.gateway, token),
          options.timeout, f"sites {', '.join(state.sites)} to come online")


def _wait(state: PocState, ready: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `ready`; PocFailed when a process of the POC ended meanwhile, or on the timeout."""
    deadline = time.monotonic() + timeout
    while not ready():
        for entry in state.processes:
            if not procs.alive(entry):
                raise PocFailed(_ended(state, entry))
        if time.monotonic() > deadline:
            raise PocFailed(f"timed out after {timeout:.0f} s waiting for {what}: see the logs "
                            f"in {Path(state.root) / 'logs'}")
        time.sleep(0.2)


def _ended(state: PocState, entry: ProcessEntry) -> str:
    taken = _taken_port(state, entry)
    if taken is not None:
        return taken
    code = procs.exit_code(entry)
    log = Path(entry.log)
    said = probes.last_words(log)
    return (f"{entry.name} ended at start{'' if code is None else f' (exit code {code})'}"
            f"{': ' + said if said else ''}; see {log}")


def _taken_port(state: PocState, entry: ProcessEntry) -> str | None:
    """Why a process that listens ended at start, when a port it was given is taken now."""
    if entry.name == "gateway":
        port = int(state.gateway.rsplit(":", 1)[1])
        if not checks.can_listen(GATEWAY_HOST, port):
            return checks.port_taken(port, "gateway", "--port")
    if entry.name == "seaweedfs":  # its ports were free when picked: another program was faster
        for arg in entry.argv:
            option, _, value = arg.lstrip("-").partition("=")
            if option in PORT_OPTIONS and not checks.can_listen(GATEWAY_HOST, int(value)):
                return (f"port {value} (-{option} of the embedded S3 server) was taken while "
                        "it started: run the command again (it picks other free ports)")
    return None
