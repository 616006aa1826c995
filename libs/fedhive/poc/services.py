"""What a POC runs: the fedhive services' command lines and environment, and the files they
read (site folders, the admins file, the admin's CLI config).

Options are tuned for one machine and a demo: the scheduler retries soon, sites beat every
2 s and count as offline after 8 s without one.
"""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fedhive.auth import hash_token, new_token
from fedhive.config import Settings, child_environment
from fedhive.poc.layout import ADMIN, MARKER, PocLayout, write_private

HEARTBEAT_S = 2
SITE_TTL_S = 8
SCHEDULER_OPTIONS = ("--min-schedule-interval", "1", "--max-schedule-interval", "15",
                     "--tick", "0.5")
RESOURCES = {  # no GPUs asked for or given: any job without a resource_spec runs
    "format_version": 2,
    "components": [
        {"id": "resource_manager", "path": "fedhive.resources.gpu.GPUResourceManager",
         "args": {"num_of_gpus": 0, "mem_per_gpu_in_GiB": 0, "expiration_period": 300}},
        {"id": "resource_consumer", "path": "fedhive.resources.gpu.GPUResourceConsumer",
         "args": {}},
    ],
}


@dataclass(frozen=True)
class Command:
    name: str
    argv: list[str]
    cwd: Path


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-c", f"from {module} import main; main()", *args]


def commands(layout: PocLayout, sites: list[str], gateway: str) -> list[Command]:
    """Job-store, scheduler, job-runner, gateway and one agent per site, in start order."""
    root = layout.root
    found = [
        Command("job-store", _python("fedhive_services.job_store.main"), root),
        Command("scheduler", _python("fedhive_services.scheduler.main", *SCHEDULER_OPTIONS),
                root),
        Command("job-runner", _python(
            "fedhive_services.job_runner.main", "--runner-id", "poc", "--work-dir",
            str(layout.runner_dir), "--site-ttl", str(SITE_TTL_S)), layout.runner_dir),
        Command("gateway", _python(
            "fedhive_services.gateway.main", "--admins", str(layout.admins), "--listen", gateway,
            "--watch-interval", "0.2"), root),
    ]
    found += [Command(f"site-{site}", _python("fedhive_services.site_agent.main", "run",
                                              "--site-dir", str(layout.site_dir(site))),
                      layout.site_dir(site)) for site in sites]
    return found


# The static S3 keys a services process gets from `settings` only; its other AWS_* variables
# (a profile, a role's web identity, the container or instance metadata endpoints) stay, so a POC
# pointed at a real S3 resolves credentials through boto3's chain as a deployment does.
_STATIC_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def environment(settings: Settings, layout: PocLayout, *, site: bool = False) -> dict[str, str]:
    """This process's environment without its FEDHIVE_* variables, plus those that make
    `Settings.from_env()` equal `settings`, plus the POC marker. A site agent (`site`) gets no
    broker, Redis or S3 setting nor any AWS_* variable: its broker URL is in its site.json, and
    a site holds no credentials of the services (its client jobs and trainers inherit its
    environment)."""
    dropped = ("FEDHIVE_", "AWS_") if site else ("FEDHIVE_", *_STATIC_KEYS)
    env = {k: v for k, v in child_environment().items() if not k.startswith(dropped)}
    if site:
        env.update({"FEDHIVE_LOG_LEVEL": settings.log_level,
                    "FEDHIVE_INLINE_THRESHOLD": str(settings.inline_threshold),
                    MARKER: str(layout.root)})
        return env
    values = {
        "FEDHIVE_AMQP_URL": settings.amqp_url,
        "FEDHIVE_AMQP_CA_FILE": settings.amqp_ca_file,
        "FEDHIVE_REDIS_URL": settings.redis_url,
        "FEDHIVE_REDIS_CA_FILE": settings.redis_ca_file,
        "FEDHIVE_REDIS_CLUSTER": "1" if settings.redis_cluster else None,
        "FEDHIVE_S3_ENDPOINT_URL": settings.s3_endpoint_url,
        "FEDHIVE_S3_PUBLIC_ENDPOINT_URL": settings.s3_public_endpoint_url,
        "FEDHIVE_S3_BUCKET": settings.s3_bucket,
        "FEDHIVE_NAMESPACE": settings.namespace,
        "FEDHIVE_INLINE_THRESHOLD": str(settings.inline_threshold),
        "FEDHIVE_LOG_LEVEL": settings.log_level,
        "AWS_REGION": settings.s3_region,
        "AWS_ACCESS_KEY_ID": settings.aws_access_key_id,
        "AWS_SECRET_ACCESS_KEY": settings.aws_secret_access_key,
        "AWS_SESSION_TOKEN": settings.aws_session_token,
        MARKER: str(layout.root),
    }
    env.update({k: v for k, v in values.items() if v})
    return env


@dataclass(frozen=True)
class SiteLink:
    """What every site of a POC is told about the deployment besides its own broker URL."""

    namespace: str
    services_user: str  # the broker user whose commands its agent takes
    storage_url: str  # where its app bundles come from (`S3BlobStore.url_prefix`)
    broker_ca_file: str | None = None  # the services' FEDHIVE_AMQP_CA_FILE: the same broker


def write_site(layout: PocLayout, site: str, broker_url: str, link: SiteLink) -> Path:
    folder = layout.site_dir(site)
    (folder / "local").mkdir(parents=True, exist_ok=True)
    config = {"site": site, "org": "poc", "broker_url": broker_url,
              "namespace": link.namespace, "services_user": link.services_user,
              "storage_url": link.storage_url, "heartbeat_interval_s": HEARTBEAT_S,
              "abort_grace_s": 5}
    if link.broker_ca_file:
        config["broker_ca_file"] = str(Path(link.broker_ca_file).resolve())
    write_private(folder / "local" / "site.json", json.dumps(config, indent=2) + "\n")
    (folder / "local" / "resources.json").write_text(json.dumps(RESOURCES, indent=2) + "\n")
    return folder


def admin_token(layout: PocLayout, gateway: str) -> str:
    """The POC admin's token: the one of an earlier start when its files are still there (an
    exported FEDHIVE_TOKEN keeps working), else a new one; (re)writes the admins file and the
    CLI config for `gateway`."""
    token = _earlier_token(layout)
    if token is None:
        token = new_token()
    name, org, role = ADMIN
    admins = {"admins": [{"name": name, "org": org, "role": role,
                          "token_sha256": hash_token(token)}]}
    write_private(layout.admins, json.dumps(admins, indent=2) + "\n")
    write_private(layout.cli_config, f'gateway = "{gateway}"\ntoken = "{token}"\n')
    return token


def _earlier_token(layout: PocLayout) -> str | None:
    try:
        token = tomllib.loads(layout.cli_config.read_text()).get("token")
        entries = json.loads(layout.admins.read_text())["admins"]
    except (OSError, ValueError, LookupError, TypeError):
        return None
    if isinstance(token, str) and any(e.get("token_sha256") == hash_token(token)
                                      for e in entries if isinstance(e, dict)):
        return token
    return None
