"""A hub site's `local/hub.json` (see `hub` for what a hub does), read and checked without
importing the SDK: ordinary sites and their client jobs never load gRPC for it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedhive.errors import ConfigError

if TYPE_CHECKING:
    from fedhive.sdk import Session

HUB_FILE = "local/hub.json"
ENDED_MARK = ".hub-ended"  # left in a hub client job's folder once it ended the lower job
_KNOWN = ("gateway", "token_file", "root_certificates", "sites", "min_clients", "resource_spec",
          "project", "task_read_wait_time", "task_wait_time", "controller_wait_time")


@dataclass(frozen=True)
class HubConfig:
    path: Path
    gateway: str
    token: str = field(repr=False)
    root_certificates: Path | None = None
    sites: tuple[str, ...] = ()
    min_clients: int | None = None
    resource_spec: dict[str, Any] = field(default_factory=dict)
    project: str = ""
    task_read_wait_time: float = 10.0
    task_wait_time: float | None = None
    controller_wait_time: float | None = None

    def session(self, timeout: float = 60.0) -> Session:
        from fedhive.sdk import Session  # only hubs use it (import cost: see the module doc)

        return Session(self.gateway, self.token, root_certificates=self.root_certificates,
                       timeout=timeout)


def load_hub(site_dir: Path) -> HubConfig | None:
    """`local/hub.json` checked (None when the site is no hub); ConfigError names the field."""
    path = site_dir / HUB_FILE
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}", field=HUB_FILE) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: must be a JSON object", field=HUB_FILE)
    unknown = sorted(set(raw) - set(_KNOWN))
    if unknown:
        raise ConfigError(f"{path}: unknown field {unknown[0]!r} (known: {', '.join(_KNOWN)})",
                          field=unknown[0])
    gateway = raw.get("gateway")
    if not isinstance(gateway, str) or ":" not in gateway:
        raise ConfigError(f"{path}: field 'gateway' must be host:port of the lower tier's "
                          f"gateway, got {gateway!r}", field="gateway")
    token = _secret(path, raw.get("token_file"))
    certificates = raw.get("root_certificates")
    if certificates is not None:
        certificates = path.parent / str(certificates)
        if not certificates.is_file():
            raise ConfigError(f"{path}: field 'root_certificates': {certificates} is not a file",
                              field="root_certificates")
    sites = raw.get("sites", [])
    if not isinstance(sites, list) or not all(isinstance(s, str) and s for s in sites):
        raise ConfigError(f"{path}: field 'sites' must be a list of site names",
                          field="sites")
    min_clients = raw.get("min_clients")
    if min_clients is not None and (isinstance(min_clients, bool)
                                    or not isinstance(min_clients, int) or min_clients < 1):
        raise ConfigError(f"{path}: field 'min_clients' must be a whole number from 1",
                          field="min_clients")
    spec = raw.get("resource_spec", {})
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: field 'resource_spec' must be an object",
                          field="resource_spec")
    project = raw.get("project", "")
    if not isinstance(project, str):
        raise ConfigError(f"{path}: field 'project' must be a string", field="project")
    return HubConfig(path, gateway, token, certificates, tuple(sites), min_clients, spec,
                     project, _seconds(path, raw, "task_read_wait_time", 10.0) or 10.0,
                     _seconds(path, raw, "task_wait_time", None),
                     _seconds(path, raw, "controller_wait_time", None))


def _secret(path: Path, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: field 'token_file' is required (a file holding an admin "
                          "token of the lower tier)", field="token_file")
    token_path = path.parent / name
    try:
        token = token_path.read_text(encoding="utf-8").strip()
    except OSError as err:
        raise ConfigError(f"{path}: field 'token_file': cannot read {token_path}: "
                          f"{err.strerror}", field="token_file") from None
    if not token:
        raise ConfigError(f"{path}: field 'token_file': {token_path} is empty",
                          field="token_file")
    return token


def _seconds(path: Path, raw: dict[str, Any], name: str, default: float | None,
             ) -> float | None:
    value = raw.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{path}: field {name!r} must be a positive number of seconds or "
                          f"null, got {value!r}", field=name)
    return float(value)
