"""The rules of a job's meta.json and of its apps, every violation collected in one pass.

A violation is one line `job '<name>': <field>: <problem>`. Checks never stop at the first
problem: an author fixing a job sees the whole list at once (FLARE reports only the first).
Numbers, sizes and nesting are held to `fedhive.jobs.limits`; every value a line quotes is
clipped (`fedhive.text.clip`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fedhive.jobs import limits
from fedhive.jobs.components import check_components
from fedhive.jobs.files import JobFiles
from fedhive.jobs.jsontext import JsonProblem, parse_json
from fedhive.jobs.operators import operator_problems
from fedhive.jobs.record import JobMeta
from fedhive.text import ECHO_LIMIT, clip

SERVER = "server"
ALL_SITES = "@ALL"
SERVER_CONFIG = "config/config_fed_server.json"
CLIENT_CONFIG = "config/config_fed_client.json"
META_FILE = "meta.json"
KNOWN_META_KEYS = ("name", "resource_spec", "deploy_map", "min_clients", "mandatory_clients")
MAX_RUNTIME_KEY = "max_runtime"  # kept with the other keys in `extra`; the job-runner reads it

# Site names become queue names (`{ns}.site.<site>`), Redis keys and broker users. No '.':
# topic bindings such as `{ns}.site.*` treat it as a word separator. No ':' (Redis separator).
SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a folder name in the job
_MAX_JOB_NAME = 128


def site_name_problem(name: object) -> str | None:
    """Why `name` cannot be a site's name, or None."""
    if not isinstance(name, str):
        return f"site names are strings, got {_json(name)}"
    if name.lower() in (SERVER, ALL_SITES.lower()):
        return f"{name!r} is reserved (the server is 'server', every site is '@ALL')"
    if not SITE_NAME.match(name):
        return f"invalid site name {clip(name)} (letters, digits, '-', '_'; at most 63)"
    return None


@dataclass(frozen=True)
class AppConfigs:
    """The parsed config files an app needs for where it is deployed (None: not needed)."""

    server: dict[str, Any] | None
    client: dict[str, Any] | None


class Checker:
    """Collects violations for one job; `job` names it in every line."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.violations: list[str] = []
        self.first_field: str | None = None

    def add(self, field: str, problem: str) -> None:
        self.first_field = self.first_field or field
        self.violations.append(f"job {clip(self.job, _MAX_JOB_NAME)}: {field}: {problem}")

    # meta.json --------------------------------------------------------------------------
    def meta(self, raw: Mapping[str, Any], default_name: str) -> JobMeta | None:
        """The typed meta, or None when a typed field is unusable (violations are recorded)."""
        size = len(json.dumps(raw, separators=(",", ":"), ensure_ascii=False).encode())
        if size > limits.MAX_META_BYTES:
            self.add(META_FILE, f"holds {size} bytes of JSON (written compactly), more than the "
                                f"limit of {limits.MAX_META_BYTES}")
            return None
        before = len(self.violations)
        name = self._name(raw.get("name", default_name))
        deploy_map = self._deploy_map(raw.get("deploy_map"))
        sites = sorted({t for ts in deploy_map.values() for t in ts} - {SERVER, ALL_SITES})
        to_all = any(ALL_SITES in ts for ts in deploy_map.values())
        min_clients = self._min_clients(raw.get("min_clients"), sites, to_all)
        mandatory = self._mandatory(raw.get("mandatory_clients", []), sites, to_all)
        resource_spec = self._resource_spec(raw.get("resource_spec", {}), sites, to_all)
        self._max_runtime(raw.get(MAX_RUNTIME_KEY))
        for path, number in _numbers({k: v for k, v in raw.items() if k not in KNOWN_META_KEYS}):
            if isinstance(number, int) and abs(number) > limits.MAX_META_INTEGER \
                    and path != MAX_RUNTIME_KEY:
                self.add(path, f"integer {_json(number)} is beyond the limit of +-2**53 (it "
                               "could not be stored exactly)")
        if len(self.violations) > before:
            return None
        extra = {k: v for k, v in raw.items() if k not in KNOWN_META_KEYS}
        return JobMeta(name, resource_spec, deploy_map, min_clients, mandatory, extra)

    def _name(self, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            self.add("name", "must be a non-empty string")
        elif len(value) > _MAX_JOB_NAME or any(ord(ch) < 32 for ch in value):
            self.add("name", f"must be one line of at most {_MAX_JOB_NAME} characters")
        else:
            return value
        return ""

    def _deploy_map(self, value: Any) -> dict[str, list[str]]:
        if value is None:
            self.add("deploy_map", "is missing")
            return {}
        if not isinstance(value, dict):
            self.add("deploy_map", "must be an object {app: [sites]}")
            return {}
        if not value:
            self.add("deploy_map", "is empty")
            return {}
        result: dict[str, list[str]] = {}
        for app, targets in value.items():
            field = f"deploy_map[{clip(app)}]"
            if not APP_NAME.match(app):
                self.add(field, "invalid app name (letters, digits, '.', '-', '_'; at most 128)")
            if not isinstance(targets, list):
                self.add(field, "must be a list of site names, 'server' or '@ALL'")
                continue
            result[app] = self._targets(field, targets)
        self._placement(result)
        return result

    def _targets(self, field: str, targets: list[Any]) -> list[str]:
        found: list[str] = []
        for target in targets:
            if isinstance(target, str) and target.upper() == ALL_SITES:
                target = ALL_SITES  # FLARE accepts any case of @ALL
            elif target != SERVER and (problem := site_name_problem(target)) is not None:
                self.add(field, problem)
                continue
            if target in found:
                self.add(field, f"{target!r} is listed twice")
            else:
                found.append(target)
        if ALL_SITES in found and len(found) > 1:
            self.add(field, "'@ALL' cannot be combined with other sites")
        return found

    def _placement(self, deploy_map: dict[str, list[str]]) -> None:
        """Exactly one server app; no site gets two apps; '@ALL' leaves no site to others."""
        to_all = sorted(app for app, ts in deploy_map.items() if ALL_SITES in ts)
        if to_all:
            others = sorted(app for app, ts in deploy_map.items() if ts and app not in to_all)
            if len(to_all) > 1 or others:
                self.add(
                    "deploy_map",
                    f"'@ALL' gives the server and every site to {clip(to_all[0])}, yet "
                    f"{', '.join(clip(a) for a in [*to_all[1:], *others])} also deploy(s)",
                )
            return
        owners: dict[str, list[str]] = {}
        for app, targets in deploy_map.items():
            for target in targets:
                owners.setdefault(target, []).append(app)
        servers = owners.pop(SERVER, [])
        if not servers:
            self.add("deploy_map", "no app is deployed to 'server'")
        elif len(servers) > 1:
            self.add("deploy_map", f"'server' gets more than one app: {_names(servers)}")
        for site, apps in sorted(owners.items()):
            if len(apps) > 1:
                self.add("deploy_map", f"site {site!r} gets more than one app: {_names(apps)}")
        if deploy_map and not owners:
            self.add("deploy_map", "no app is deployed to any site (only to the server)")

    def _min_clients(self, value: Any, sites: list[str], to_all: bool) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.add("min_clients", f"must be an integer, got {_json(value)}")
        elif value < 1:
            self.add("min_clients", f"must be positive, got {value}")
        elif value > limits.MAX_MIN_CLIENTS:
            self.add("min_clients", f"must be at most {limits.MAX_MIN_CLIENTS}, got {clip(value)}")
        elif not to_all and sites and value > len(sites):
            self.add("min_clients", f"{value} is more than the {len(sites)} site(s) deployed to")
        else:
            return value
        return None

    def _mandatory(self, value: Any, sites: list[str], to_all: bool) -> list[str]:
        if not isinstance(value, list):
            self.add("mandatory_clients", "must be a list of site names")
            return []
        for site in value:
            if (problem := site_name_problem(site)) is not None:
                self.add("mandatory_clients", problem)
            elif not to_all and site not in sites:
                self.add("mandatory_clients", f"site {site!r} is not in the deploy_map")
        return [s for s in value if isinstance(s, str)]

    def _resource_spec(self, value: Any, sites: list[str], to_all: bool) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.add("resource_spec", "must be an object {site: {resource: value}}")
            return {}
        for site, spec in value.items():
            field = f"resource_spec[{clip(site)}]"
            if (problem := site_name_problem(site)) is not None:
                self.add(field, problem)
            elif not to_all and site not in sites:
                self.add(field, "is not a site in the deploy_map")
            if not isinstance(spec, dict):
                self.add(field, "must be an object {resource: value}")
                continue
            for path, amount in _numbers(spec, field):
                bound = limits.MAX_RESOURCE_AMOUNT
                if not 0 <= amount <= bound:
                    self.add(path, f"must be a number between 0 and {bound}, got {_json(amount)}")
        return dict(value)

    def _max_runtime(self, value: Any) -> None:
        if value is None:
            return
        bound = limits.MAX_RUNTIME_S
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= bound:
            self.add(MAX_RUNTIME_KEY,
                     f"must be a number of seconds above 0 and at most {bound}, got {_json(value)}")

    # apps -----------------------------------------------------------------------------
    def apps(self, files: JobFiles, deploy_map: Mapping[str, list[str]]) -> dict[str, AppConfigs]:
        """Each deploy_map app exists with the config files its targets need, all valid."""
        result: dict[str, AppConfigs] = {}
        for app, targets in deploy_map.items():
            if not files.has_dir(app):
                self.add(f"deploy_map[{clip(app)}]",
                         f"app folder {clip(app + '/')} is not in the job")
                continue
            to_server = SERVER in targets or ALL_SITES in targets
            to_sites = any(t != SERVER for t in targets)
            server = self._config(files, app, SERVER_CONFIG, "server") if to_server else None
            client = self._config(files, app, CLIENT_CONFIG, "sites") if to_sites else None
            result[app] = AppConfigs(server, client)
        return result

    def _config(self, files: JobFiles, app: str, config: str, role: str) -> dict[str, Any] | None:
        name = f"{app}/{config}"
        if not files.has_file(name):
            self.add(name, f"is missing (app {clip(app)} is deployed to {role})")
            return None
        parsed = self.json_object(name, files.read(name), limits.MAX_CONFIG_DEPTH)
        if parsed is not None:
            problems = check_components(parsed, name)
            if role == "server":
                problems += operator_problems(parsed, name)
            for field, problem in problems:
                self.add(field, problem)
        return parsed

    def json_object(self, name: str, content: bytes, max_depth: int) -> dict[str, Any] | None:
        """Parse a JSON object file, recording a violation (naming the line where there is one)
        on failure."""
        try:
            parsed = parse_json(content, max_depth=max_depth)
        except JsonProblem as err:
            self.add(name, str(err))
            return None
        if not isinstance(parsed, dict):
            self.add(name, "must be a JSON object")
            return None
        return parsed


def _numbers(value: Any, path: str = "") -> Iterator[tuple[str, int | float]]:
    """Every number in `value` with where it is (`key['sub'][2]`), iteratively: nesting is
    bounded by the parser, but a walk must not depend on it."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            children = [(f"{where}[{clip(k)}]" if where else _key(k), v) for k, v in item.items()]
            stack += reversed(children)  # popped in the file's order
        elif isinstance(item, list):
            stack += reversed([(f"{where}[{i}]", v) for i, v in enumerate(item)])
        elif isinstance(item, int | float) and not isinstance(item, bool):
            yield where, item


def _key(key: str) -> str:
    return key if key.isidentifier() and len(key) <= ECHO_LIMIT else clip(key)


def _names(names: list[str]) -> str:
    return ", ".join(clip(name, quote=False) for name in names)


def _json(value: Any) -> str:
    """A meta.json value as its JSON text, clipped."""
    return clip(json.dumps(value), quote=False)
