"""`fedhive admin-token`: make a bearer token for a new admin and its admins-file entry.

The token is printed once, for the admin; the gateway's admins file gets only its SHA-256.
Without `--json` the token goes to stderr and the entry (JSON) to stdout, so `>> entries` keeps
only the entry; with `--json` stdout gets `{name, token, entry}` (stderr stays empty).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from fedhive.auth import Role, hash_token, new_token


def admin_token(
    name: Annotated[str, typer.Argument(help="The admin's user name, e.g. alice@a.org.")],
    org: Annotated[str, typer.Option(help="The admin's organisation.")],
    role: Annotated[Role, typer.Option(help="The admin's role.")],
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print {name, token, entry} as JSON on stdout.")] = False,
) -> None:
    """Create a token: print it (give it to the admin) and the entry for the admins file."""
    token = new_token()
    entry = {"name": name, "org": org, "role": role.value, "token_sha256": hash_token(token)}
    if as_json:
        typer.echo(json.dumps({"name": name, "token": token, "entry": entry}))
        return
    typer.echo(f"token (give it to {name}; it is not stored anywhere): {token}", err=True)
    typer.echo(json.dumps(entry))
