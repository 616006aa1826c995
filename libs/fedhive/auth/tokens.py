"""Admin bearer tokens: generated at random, stored only as hashes, looked up by hash.

Tokens are 256-bit random strings (`new_token()`), so a plain SHA-256 is the right hash: a
slow password hash protects guessable secrets, and these are not guessable. The admins file
never holds a token, only `token_sha256`; a leaked file lets nobody in.

The admins file (JSON; see deploy/admins.example.json):

    {"admins": [{"name": "alice@a.org", "org": "a", "role": "lead",
                 "token_sha256": "<64 hex digits>"}]}

Names, orgs and roles are compared in lower case, as FLARE does.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhive.auth.policy import Role
from fedhive.errors import ConfigError, Unauthenticated
from fedhive.jobs.record import Submitter

TOKEN_PREFIX = "fh_"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_FIELDS = ("name", "org", "role", "token_sha256")


def new_token() -> str:
    """A fresh bearer token (show it to the admin once; store only `hash_token(token)`)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """The hex SHA-256 of a token: what the admins file stores."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Admin:
    """An authenticated caller of the gateway."""

    name: str
    org: str
    role: Role

    def as_submitter(self) -> Submitter:
        return Submitter(name=self.name, org=self.org, role=self.role.value)


class AdminDirectory:
    """Token hash -> admin, loaded once from the admins file by the gateway's composition root."""

    def __init__(self, admins: Mapping[str, Admin]) -> None:
        self._by_hash = dict(admins)

    def __len__(self) -> int:
        return len(self._by_hash)

    @classmethod
    def load(cls, path: Path) -> AdminDirectory:
        """Read and check the admins file; `ConfigError` names the file, entry and field."""
        try:
            raw = json.loads(path.read_text())
        except OSError as err:
            raise ConfigError(f"admins file {path}: {err.strerror}", field=str(path)) from None
        except json.JSONDecodeError as err:
            raise ConfigError(
                f"admins file {path}: invalid JSON at line {err.lineno}: {err.msg}",
                field=str(path),
            ) from None
        return cls.parse(raw, source=str(path))

    @classmethod
    def parse(cls, raw: Any, *, source: str = "admins") -> AdminDirectory:
        entries = raw.get("admins") if isinstance(raw, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{source}: 'admins' must be a non-empty list", field="admins")
        by_hash: dict[str, Admin] = {}
        names: set[str] = set()
        for index, entry in enumerate(entries):
            admin, digest = _entry(entry, f"{source}: admins[{index}]")
            if admin.name in names:
                raise ConfigError(f"{source}: admins[{index}]: duplicate name {admin.name!r}",
                                  field="name")
            if digest in by_hash:
                raise ConfigError(f"{source}: admins[{index}]: token_sha256 is already used by "
                                  f"{by_hash[digest].name!r}", field="token_sha256")
            names.add(admin.name)
            by_hash[digest] = admin
        return cls(by_hash)

    def authenticate(self, token: str | None) -> Admin:
        """The admin a bearer token belongs to, or `Unauthenticated` (never says which part)."""
        if not token:
            raise Unauthenticated("no bearer token: send 'authorization: Bearer <token>'",
                                  field="authorization")
        admin = self._by_hash.get(hash_token(token))
        if admin is None:
            raise Unauthenticated("invalid bearer token", field="authorization")
        return admin


def _entry(entry: Any, where: str) -> tuple[Admin, str]:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object", field="admins")
    for key in _FIELDS:
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise ConfigError(f"{where}: {key!r} must be a non-empty string", field=key)
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (a plain token must "
                          "never be stored: use token_sha256)", field=unknown[0])
    digest = entry["token_sha256"].strip().lower()
    if not _HEX64.match(digest):
        raise ConfigError(f"{where}: token_sha256 must be 64 hex digits", field="token_sha256")
    role_name = entry["role"].strip().lower()
    try:
        role = Role(role_name)
    except ValueError:
        raise ConfigError(
            f"{where}: role {role_name!r} is not one of {', '.join(r.value for r in Role)}",
            field="role",
        ) from None
    name, org = entry["name"].strip().lower(), entry["org"].strip().lower()
    return Admin(name=name, org=org, role=role), digest
