"""Bearer tokens and the admins file: hashed storage, lookup, and one-line config errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedhive.auth import Admin, AdminDirectory, Role, hash_token, new_token
from fedhive.errors import ConfigError, Unauthenticated

REPO = Path(__file__).resolve().parents[2]


def _entry(name: str = "alice@a.org", token: str = "t0k3n", **over: Any) -> dict[str, Any]:
    entry = {"name": name, "org": "A", "role": "Lead", "token_sha256": hash_token(token)}
    entry.update(over)
    return entry


def test_tokens_are_random_and_hashed_as_sha256_hex() -> None:
    first, second = new_token(), new_token()
    assert first != second and first.startswith("fh_") and len(first) > 40
    assert hash_token("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_authenticate_maps_a_token_to_its_admin_in_lower_case() -> None:
    directory = AdminDirectory.parse({"admins": [_entry(), _entry("bob", "other", role="member")]})
    assert len(directory) == 2
    assert directory.authenticate("t0k3n") == Admin("alice@a.org", "a", Role.LEAD)
    assert directory.authenticate("other").role is Role.MEMBER
    assert directory.authenticate("t0k3n").as_submitter().role == "lead"


@pytest.mark.parametrize(("token", "message"), [
    (None, "no bearer token"), ("", "no bearer token"), ("wrong", "invalid bearer token"),
])
def test_unknown_or_missing_tokens_are_unauthenticated(token: str | None, message: str) -> None:
    directory = AdminDirectory.parse({"admins": [_entry()]})
    with pytest.raises(Unauthenticated, match=message):
        directory.authenticate(token)


@pytest.mark.parametrize(("raw", "message"), [
    ({}, "'admins' must be a non-empty list"),
    ({"admins": []}, "'admins' must be a non-empty list"),
    ({"admins": ["x"]}, r"admins\[0\] must be an object"),
    ({"admins": [_entry(role="owner")]}, "role 'owner' is not one of project_admin"),
    ({"admins": [_entry(org="")]}, "'org' must be a non-empty string"),
    ({"admins": [_entry(token_sha256="abc")]}, "token_sha256 must be 64 hex digits"),
    ({"admins": [{**_entry(), "token": "plain"}]}, r"unknown key\(s\) token"),
    ({"admins": [_entry(), _entry(token="x")]}, "duplicate name 'alice@a.org'"),
    ({"admins": [_entry(), _entry("bob")]}, "already used by 'alice@a.org'"),
])
def test_bad_admins_files_are_refused_in_one_line(raw: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        AdminDirectory.parse(raw)
    assert "\n" not in str(caught.value)


def test_load_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "admins.json"
    with pytest.raises(ConfigError, match=f"admins file {path}: No such file"):
        AdminDirectory.load(path)
    path.write_text('{"admins": [\n oops]}')
    with pytest.raises(ConfigError, match="invalid JSON at line 2"):
        AdminDirectory.load(path)
    path.write_text(json.dumps({"admins": [_entry()]}))
    assert AdminDirectory.load(path).authenticate("t0k3n").name == "alice@a.org"


def test_the_example_admins_file_loads() -> None:
    assert len(AdminDirectory.load(REPO / "deploy" / "admins.example.json")) == 4
