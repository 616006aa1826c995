"""The rules of a job's meta and of its apps, every violation collected in one pass.

A violation is one line `job '<name>': <field>: <problem>`. Checks never stop at the first
problem: an author fixing a job sees the whole list at once (FLARE reports only the first).
Numbers, sizes and nesting are held to `fedhive.jobs.limits`; every value a line quotes is
clipped (`fedhive.text.clip`). The meta and the app configs may be written in any of FLARE's
forms (JSON, HOCON, YAML: `fedhive.jobs.documents`); an app config is checked as fedhive will
build it, FLARE's component paths mapped (`fedhive.jobs.flare_config`).

A deploy_map entry takes FLARE's forms: a list of targets, one target as a string,
`{"sites": [...]}` / `{"targets": [...]}`, or a list mixing strings and such objects; the
stored meta has the flat list. `resource_spec["@default"]` is the spec of every site without an
entry of its own: for a deploy_map naming its sites it is written out into each of them (the
stored meta has no `@default`); with `@ALL` it is kept, for the scheduler to apply
(`JobMeta.resource_spec_for`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fedhive.jobs import documents, limits
from fedhive.jobs.components import check_components
from fedhive.jobs.custom_code import CustomCode, ScanBudget
from fedhive.jobs.files import JobFiles
from fedhive.jobs.flare_config import translate_config
from fedhive.jobs.formats import is_text_form, parse_document
from fedhive.jobs.jsontext import JsonProblem
from fedhive.jobs.operators import operator_problems
from fedhive.jobs.record import DEFAULT_SPEC, JobMeta
from fedhive.text import ECHO_LIMIT, clip

SERVER = "server"
ALL_SITES = "@ALL"
SERVER_CONFIG = "config/config_fed_server.json"
CLIENT_CONFIG = "config/config_fed_client.json"
META_FILE = "meta.json"  # what fedhive stores; a job may come with meta.conf, .yml or .yaml
DEPLOY_KEYS = ("sites", "targets")  # the keys of a deploy_map entry's object form
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
    """The config files an app needs for where it is deployed (None: not needed), parsed and
    translated as the server and client jobs build them (FLARE's paths mapped)."""

    server: dict[str, Any] | None
    client: dict[str, Any] | None


class Checker:
    """Collects violations for one job; `job` names it in every line."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.violations: list[str] = []
        self.first_field: str | None = None
        self.text_form_bytes = 0  # HOCON and YAML read so far (MAX_TEXT_FORM_TOTAL)
        self.custom_budget = ScanBudget()  # custom/ code the checks may still read

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
            flat = deploy_targets(targets, functools.partial(self.add, field), self.job)
            if flat is not None:
                result[app] = self._targets(field, flat)
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
            if site == DEFAULT_SPEC:
                pass  # every site without an entry of its own
            elif (problem := site_name_problem(site)) is not None:
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
        default = value.get(DEFAULT_SPEC)
        if to_all or not isinstance(default, dict):
            return dict(value)
        own = {k: v for k, v in value.items() if k != DEFAULT_SPEC}
        return {**own, **{site: dict(default) for site in sites if site not in own}}

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
            custom = CustomCode(files, app, self.custom_budget)
            server = self._config(files, app, SERVER_CONFIG, "server", custom) \
                if to_server else None
            client = self._config(files, app, CLIENT_CONFIG, "sites", custom) \
                if to_sites else None
            result[app] = AppConfigs(server, client)
        return result

    def _config(self, files: JobFiles, app: str, config: str, role: str,
                custom: CustomCode) -> dict[str, Any] | None:
        """The app's config, parsed in whichever form it has and translated as it will be
        built (`fedhive.jobs.flare_config`); None when missing or unusable."""
        found = documents.find(files, f"{app}/{config.removesuffix('.json')}")
        if len(found) != 1:
            if found:
                self.add(found[0], documents.two_forms(found))
            else:
                self.add(f"{app}/{config}", f"is missing (app {clip(app)} is deployed to {role})")
            return None
        name = found[0]
        parsed = self.document(files, name, limits.MAX_CONFIG_DEPTH, None)
        if parsed is None:
            return None
        translated = translate_config(parsed, name, custom)
        problems = translated.problems + check_components(translated.config, name, custom)
        if role == "server":
            problems += operator_problems(translated.config, name)
        for field, problem in problems:
            self.add(field, problem)
        return translated.config

    def document(self, files: JobFiles, name: str, max_depth: int,
                 max_bytes: int | None) -> dict[str, Any] | None:
        """Read and parse an object document (JSON, HOCON or YAML, by its name), recording a
        violation (naming the line where there is one) when it is too large or unusable."""
        size = files.size(name)
        problem = documents.size_problem(name, size, max_bytes)
        if problem is None and is_text_form(name):
            self.text_form_bytes += size
            if self.text_form_bytes > limits.MAX_TEXT_FORM_TOTAL:
                problem = (f"makes {self.text_form_bytes} bytes of HOCON and YAML in the job, "
                           f"more than the limit of {limits.MAX_TEXT_FORM_TOTAL}")
        if problem is not None:
            self.add(name, problem)
            return None
        try:
            parsed = parse_document(name, files.read(name), max_depth=max_depth)
        except JsonProblem as err:
            self.add(name, str(err))
            return None
        if not isinstance(parsed, dict):
            self.add(name, "must be a JSON object" if name.endswith(".json")
                     else "must be an object")
            return None
        return parsed


def deploy_targets(value: Any, report: Callable[[str], None] | None = None,
                   job: str = "") -> list[Any] | None:
    """The targets of a deploy_map entry in any of FLARE's forms, flat (not yet checked as
    names); None when the entry has no usable form. `report` gets each problem."""
    say = report or (lambda problem: None)
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return _deploy_object(value, say, job)
    if not isinstance(value, list):
        say("must be a list of site names, 'server' or '@ALL', one of them, or "
            "{\"sites\": [...]}")
        return None
    flat: list[Any] = []
    for item in value:
        if isinstance(item, dict):
            flat += _deploy_object(item, say, job)
        else:
            flat.append(item)
    return flat


def _deploy_object(value: dict[str, Any], say: Callable[[str], None], job: str) -> list[Any]:
    """`{"sites": [...]}` / `{"targets": [...]}` (both: their union), with FLARE's message for
    another key."""
    unknown = sorted(str(k) for k in value if k not in DEPLOY_KEYS)
    if unknown:
        keys = ", ".join(clip(k) for k in unknown)
        say(f"Unknown keys {{{keys}}} in deploy_map entry for job {clip(job, quote=False)}. "
            f"Valid keys are: {list(DEPLOY_KEYS)}")
    flat: list[Any] = []
    for key in DEPLOY_KEYS:
        targets = value.get(key)
        if targets is None:
            continue
        if not isinstance(targets, list):
            say(f"{key!r} must be a list of site names, 'server' or '@ALL', not {_json(targets)}")
            continue
        flat += targets
    return flat


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
