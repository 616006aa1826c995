"""A site folder: `local/site.json` (who the site is, how it reaches the broker) and
`local/resources.json` (its resource manager and consumer, seed 001's format).

`site.json`:

    {
      "site": "hospital-a",                  required; becomes the control queue's name
      "org": "Hospital A",                   optional, ""
      "broker_url": "amqps://fedhive.hospital-a:SECRET@broker.example.org:5671/%2F",  required;
                                             its user must be the site's broker user,
                                             <namespace>.<site>
      "broker_ca_file": "local/broker-ca.pem",  optional: the PEM of the CA that signs the
                                             broker's certificate (an amqps:// broker_url only),
                                             relative to the site folder or absolute; absent:
                                             the system's CAs (Amazon MQ, CloudAMQP). Either
                                             way the certificate must name broker_url's host
      "namespace": "fedhive",                optional, "fedhive"
      "services_user": "fedhive-services",   optional, "<namespace>-services": the broker user
                                             of the services; the agent takes commands from it
                                             only
      "storage_url": "https://s3.example.org/fedhive",  required: the deployment's object
                                             store as presigned URLs name it (endpoint and, path
                                             style, bucket); app bundles come from under it only
      "heartbeat_interval_s": 5,             optional, 5
      "workspace": "workspace",              optional, <site folder>/workspace (relative to it)
      "abort_grace_s": 10,                   optional, 10: SIGTERM, then SIGKILL after this
      "max_bundle_mib": 256,                 optional, 256: largest app bundle accepted
      "client_job_module": "fedhive_services.site_agent.client_job"  optional: what `start` runs
      "share_logs": true                     optional, true: the client jobs' log lines (their
                                             trainers' output included) go to the job-runner
                                             for `fedhive logs`; false: nothing of them leaves
                                             the site (the runner only hears that it does not
                                             share them)
    }

Trust: the agent runs only what the deployment's services send it. Its control queue takes
messages from `services_user` alone (RabbitMQ verifies the sender), and a deploy must name the
bundle of a job that holds resources here, at the deployment's own object store
(`storage_url`): a forged command cannot make it fetch and run code from anywhere else.

How settings combine: the process's `Settings.from_env()` gives only the log level; the broker
URL, its CA file and the namespace come from site.json (`agent_settings`; the client jobs read
the same file, so they reach the broker as the agent does), and every Redis/S3 credential is
dropped, so the agent cannot talk to anything but the broker. Every problem raises a
`ConfigError` naming the file and the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fedhive.bus.connection import tls_context, url_parameters
from fedhive.config import Settings
from fedhive.errors import ConfigError
from fedhive.jobs.archive import STORED, ArchiveLimits, MiB
from fedhive.jobs.validation import site_name_problem
from fedhive.names import Names
from fedhive.resources import SiteResources, load_resources

SITE_FILE = "local/site.json"
RESOURCES_FILE = "local/resources.json"
CLIENT_JOB_MODULE = "fedhive_services.site_agent.client_job"
_KNOWN = (
    "site", "org", "broker_url", "broker_ca_file", "namespace", "services_user", "storage_url",
    "heartbeat_interval_s", "workspace", "abort_grace_s", "max_bundle_mib", "client_job_module",
    "share_logs",
)
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class SiteConfig:
    site_dir: Path
    site: str
    broker_url: str = field(repr=False)  # carries the site's broker password
    storage_url: str
    broker_ca_file: Path | None = None  # None: the system's CAs
    org: str = ""
    namespace: str = "fedhive"
    services_user: str = "fedhive-services"
    heartbeat_interval_s: float = 5.0
    workspace: Path = Path("workspace")
    abort_grace_s: float = 10.0
    max_bundle_bytes: int = 256 * MiB
    client_job_module: str = CLIENT_JOB_MODULE
    share_logs: bool = True  # its client jobs' log lines go to the job-runner (`logs`)

    @property
    def archive_limits(self) -> ArchiveLimits:
        """Bundles come from the job-runner, re-zipped from a checked job: sizes are capped,
        the compression ratio is not (see `fedhive.jobs.archive.STORED`)."""
        return replace(STORED, max_archive_bytes=self.max_bundle_bytes)


def load_site(site_dir: Path) -> SiteConfig:
    """Read and check `<site_dir>/local/site.json`; ConfigError names the file and field."""
    site_dir = site_dir.resolve()
    path = site_dir / SITE_FILE
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object", field=SITE_FILE)
    fields = _Fields(path, raw)
    unknown = sorted(set(raw) - set(_KNOWN))
    if unknown:
        raise ConfigError(
            f"{path}: unknown field {unknown[0]!r} (known: {', '.join(_KNOWN)})", field=unknown[0]
        )
    site = fields.text("site", None)
    if (problem := site_name_problem(site)) is not None:
        raise ConfigError(f"{path}: field 'site': {problem}", field="site")
    broker_url = fields.text("broker_url", None)
    namespace = fields.text("namespace", "fedhive")
    try:
        Settings.from_env({"FEDHIVE_AMQP_URL": broker_url, "FEDHIVE_NAMESPACE": namespace})
    except ConfigError as err:  # reworded: the site.json field, not the variable, is named
        name = "broker_url" if err.field == "FEDHIVE_AMQP_URL" else "namespace"
        message = err.message.replace(err.field or name, name)
        raise ConfigError(f"{path}: {message}", field=name) from None
    try:
        user = url_parameters(broker_url).credentials.username
    except ConfigError as err:
        raise ConfigError(f"{path}: field 'broker_url': {err}", field="broker_url") from None
    if user != Names(namespace).site_user(str(site)):
        raise ConfigError(f"{path}: field 'broker_url': its user {user!r} is not the broker user "
                          f"of site {site!r} in namespace {namespace!r} "
                          f"({Names(namespace).site_user(str(site))!r})", field="broker_url")
    storage_url = _storage_url(path, fields.text("storage_url", None))
    broker_ca_file = _broker_ca_file(path, site_dir, broker_url, raw.get("broker_ca_file"))
    workspace = Path(fields.text("workspace", "workspace"))
    module = fields.text("client_job_module", CLIENT_JOB_MODULE)
    if not _MODULE.match(module):
        raise ConfigError(f"{path}: field 'client_job_module': {module!r} is not a module path",
                          field="client_job_module")
    return SiteConfig(
        site_dir=site_dir,
        site=str(site),
        broker_url=broker_url,
        storage_url=storage_url,
        broker_ca_file=broker_ca_file,
        org=fields.text("org", ""),
        namespace=namespace,
        services_user=fields.text("services_user", f"{namespace}-services"),
        heartbeat_interval_s=fields.seconds("heartbeat_interval_s", 5.0),
        workspace=workspace if workspace.is_absolute() else site_dir / workspace,
        abort_grace_s=fields.seconds("abort_grace_s", 10.0),
        max_bundle_bytes=int(fields.seconds("max_bundle_mib", 256) * MiB),
        client_job_module=module,
        share_logs=fields.flag("share_logs", True),
    )


def _storage_url(path: Path, value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query \
            or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"{path}: field 'storage_url': {value[:200]!r} is not an http(s) URL "
                          "of the deployment's object store (e.g. https://s3.example.org/fedhive)",
                          field="storage_url")
    return value.rstrip("/")


def _broker_ca_file(path: Path, site_dir: Path, broker_url: str, value: Any) -> Path | None:
    """The CA file as an absolute path, checked now: a file that is missing or holds no PEM
    certificate would otherwise surface only as a refused broker connection."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{path}: field 'broker_ca_file' must be a non-empty string, got "
                          f"{value!r}", field="broker_ca_file")
    if not broker_url.startswith("amqps://"):
        raise ConfigError(f"{path}: field 'broker_ca_file' needs an amqps:// broker_url (a plain "
                          "amqp:// connection has no certificate to check)", field="broker_ca_file")
    ca_file = (site_dir / value.strip()).resolve()  # an absolute path stays as it is
    if not ca_file.is_file():
        raise ConfigError(f"{path}: field 'broker_ca_file': {str(ca_file)!r} is not a file",
                          field="broker_ca_file")
    try:
        tls_context(str(ca_file))
    except ConfigError as err:
        raise ConfigError(f"{path}: field 'broker_ca_file': {err}",
                          field="broker_ca_file") from None
    return ca_file


def load_site_resources(config: SiteConfig) -> SiteResources:
    return load_resources(config.site_dir / RESOURCES_FILE)


def agent_settings(base: Settings, config: SiteConfig) -> Settings:
    """The agent's settings: log level from the environment, the broker (URL and CA file) from
    site.json, and no Redis or S3 credentials at all."""
    return replace(
        base,
        amqp_url=config.broker_url,
        amqp_ca_file=None if config.broker_ca_file is None else str(config.broker_ca_file),
        namespace=config.namespace,
        aws_access_key_id=None,
        aws_secret_access_key=None,
        aws_session_token=None,
    )


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found", field=SITE_FILE) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}", field=SITE_FILE) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}",
            field=SITE_FILE,
        ) from None


@dataclass(frozen=True)
class _Fields:
    path: Path
    raw: dict[str, Any]

    def text(self, name: str, default: str | None) -> str:
        value = self.raw.get(name, default)
        if value is None:
            raise ConfigError(f"{self.path}: field {name!r} is required", field=name)
        if default is not None and value == default:
            return default  # an optional field may default to "" (org)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(
                f"{self.path}: field {name!r} must be a non-empty string, got {value!r}",
                field=name,
            )
        return value.strip()

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.path}: field {name!r} must be true or false, got {value!r}",
                              field=name)
        return value

    def seconds(self, name: str, default: float) -> float:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ConfigError(
                f"{self.path}: field {name!r} must be a positive number, got {value!r}",
                field=name,
            )
        return float(value)
