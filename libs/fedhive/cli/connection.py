"""Where the CLI finds the gateway: options / environment first, then the config file
(`--config FILE` or FEDHIVE_CONFIG, default `~/.fedhive/config`; `fedhive poc start` writes one
for its admin).

The global options of `fedhive` (`--gateway`, `--token`, `--ca-cert`, `--client-cert`,
`--client-key`, `--tls`) read FEDHIVE_GATEWAY, FEDHIVE_TOKEN, FEDHIVE_GATEWAY_CA,
FEDHIVE_CLIENT_CERT, FEDHIVE_CLIENT_KEY and FEDHIVE_GATEWAY_TLS through typer; what is still
unset comes from the TOML config file:

    gateway = "gateway.example.org:50051"
    token = "fh_..."
    ca_cert = "/etc/fedhive/ca.pem"      # optional: TLS, trusting this CA
    client_cert = "/home/me/admin.pem"   # optional: mutual TLS
    client_key = "/home/me/admin.key"
    tls = true                           # optional: TLS with the system's CAs
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedhive.errors import ConfigError

if TYPE_CHECKING:
    from fedhive.sdk import Session  # imported by `open`: not every command talks to a gateway

CONFIG_FILE = Path("~/.fedhive/config")
CONFIG_FILE_KEY = "fedhive.config_file"  # ctx.meta: --config / FEDHIVE_CONFIG, None: CONFIG_FILE


@dataclass(frozen=True)
class GatewayTarget:
    gateway: str | None = None
    token: str | None = None
    ca_cert: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    tls: bool | None = None

    def merged(self, fallback: GatewayTarget) -> GatewayTarget:
        """These values, with `fallback`'s where these are unset."""
        return replace(self, **{
            f.name: getattr(fallback, f.name)
            for f in fields(self) if getattr(self, f.name) is None
        })

    def open(self) -> Session:
        """A session to the gateway; `ConfigError` says which setting is missing."""
        if not self.gateway:
            raise ConfigError("no gateway address: set FEDHIVE_GATEWAY, pass --gateway or put "
                              "gateway = \"host:port\" in ~/.fedhive/config", field="gateway")
        if not self.token:
            raise ConfigError("no admin token: set FEDHIVE_TOKEN, pass --token or put "
                              "token = \"...\" in ~/.fedhive/config", field="token")
        if bool(self.client_cert) != bool(self.client_key):
            raise ConfigError("client_cert and client_key go together (mutual TLS)",
                              field="client_cert")
        from fedhive.sdk import Session

        return Session(
            self.gateway, self.token, tls=bool(self.tls), root_certificates=_pem(self.ca_cert),
            client_cert=_pem(self.client_cert), client_key=_pem(self.client_key),
        )


def _pem(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}", field=str(path)) from None


def load_config_file(path: Path) -> GatewayTarget:
    """The settings in a CLI config file; a missing file is an empty one."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return GatewayTarget()
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}", field=str(path)) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}", field=str(path)) from None
    known = {f.name for f in fields(GatewayTarget)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} (known: "
                          f"{', '.join(sorted(known))})", field=unknown[0])
    values: dict[str, Any] = {}
    for key, value in raw.items():
        expected = bool if key == "tls" else str
        if not isinstance(value, expected):
            raise ConfigError(f"{path}: {key} must be a {expected.__name__}", field=key)
        # Certificate paths are relative to the config file's folder.
        is_path = isinstance(value, str) and key.endswith(("_cert", "_key"))
        values[key] = path.parent / Path(str(value)).expanduser() if is_path else value
    return GatewayTarget(**values)
