"""Write the gateway's admins file for one admin whose bearer token is FEDHIVE_TOKEN (the
variable the `fedhive` CLI reads), stored as its SHA-256 only (docker-compose.yml's one-shot
`admins` service runs it; the gateway never sees the token).

    python admins_file.py OUT --name admin@fedhive --org fedhive [--role project_admin]

For several admins, mount an admins file of your own instead (deploy/admins.example.json,
`fedhive admin-token`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fedhive.auth import AdminDirectory, Role, hash_token
from fedhive.errors import ConfigError, FedhiveError
from fedhive.poc.layout import write_private

MIN_TOKEN_CHARS = 32  # the file keeps a plain SHA-256: only a random token is safe with it


def write_admins(out: Path, token: str, name: str, org: str, role: Role) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"FEDHIVE_TOKEN must be a random string of {MIN_TOKEN_CHARS}+ chars, "
                          "e.g. python3 -c \"import secrets; print('fh_' + "
                          "secrets.token_urlsafe(32))\"", field="FEDHIVE_TOKEN")
    entry = {"name": name, "org": org, "role": role.value, "token_sha256": hash_token(token)}
    write_private(out, json.dumps({"admins": [entry]}, indent=2) + "\n")
    AdminDirectory.load(out).authenticate(token)  # as the gateway will read it


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="admins_file.py", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the admins file to (re)write")
    parser.add_argument("--name", required=True, help="the admin's name, e.g. admin@example.org")
    parser.add_argument("--org", required=True, help="the admin's organisation")
    parser.add_argument("--role", type=Role, choices=list(Role), default=Role.PROJECT_ADMIN)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        write_admins(args.out, os.environ.get("FEDHIVE_TOKEN", "").strip(), args.name, args.org,
                     args.role)
    except (FedhiveError, OSError) as err:
        print(f"admins_file.py: {err}", file=sys.stderr)
        return 2
    print(f"admin {args.name} ({args.role.value}) in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
