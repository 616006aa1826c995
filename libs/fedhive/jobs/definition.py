"""Load a job folder or zip into a validated `JobDefinition`.

Accepted layouts (for a zip, also inside one top-level folder, as FLARE's client uploads it):
* a job: its meta (`meta.json`, or FLARE's `meta.conf`, `meta.yml`, `meta.yaml`: one of them)
  plus one folder per app;
* a single app: `config/` directly at the root. It is wrapped as FLARE does: moved into a folder
  named after it and given a meta that deploys it to `@ALL`.
`load_job` raises `UnsafeArchive` (archive safety) or `InvalidJobDefinition` (the job rules),
each listing every problem; `JobDefinition.to_zip` writes the normalised archive fedhive stores.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from fedhive.jobs import documents, limits
from fedhive.jobs.archive import ArchiveLimits, Violations, write_zip
from fedhive.jobs.files import JobFiles, folder_files, zip_files
from fedhive.jobs.record import JobMeta
from fedhive.jobs.validation import (
    ALL_SITES,
    APP_NAME,
    META_FILE,
    SERVER,
    AppConfigs,
    Checker,
    deploy_targets,
)
from fedhive.text import clip

_DEFAULT_NAME = "job"


class InvalidJobDefinition(Violations):
    """The job breaks one or more rules; `violations` has one line per problem."""


@dataclass(frozen=True)
class JobDefinition:
    meta: JobMeta
    configs: dict[str, AppConfigs]  # per deploy_map app: the parsed configs its targets use
    files: JobFiles = field(repr=False)  # the apps' files (the meta file is `meta`)

    @property
    def apps(self) -> list[str]:
        return list(self.meta.deploy_map)

    @property
    def deploys_to_all(self) -> bool:
        return any(ALL_SITES in targets for targets in self.meta.deploy_map.values())

    @property
    def sites(self) -> list[str]:
        """The client sites named in the deploy_map (empty when it uses `@ALL`)."""
        targets = {t for ts in self.meta.deploy_map.values() for t in ts}
        return sorted(targets - {SERVER, ALL_SITES})

    @property
    def server_app(self) -> str:
        return next(
            app for app, ts in self.meta.deploy_map.items() if SERVER in ts or ALL_SITES in ts
        )

    def app_for(self, site: str) -> str | None:
        """The app `site` runs (`server` for the server app), or None when it runs none."""
        for app, targets in self.meta.deploy_map.items():
            if site in targets or ALL_SITES in targets:
                return app
        return None

    @property
    def byoc(self) -> bool:
        """Whether a deployed app brings its own code (`custom/`), as FLARE derives it."""
        return any(
            self.files.has_dir(f"{app}/custom") for app, ts in self.meta.deploy_map.items() if ts
        )

    def summary(self) -> str:
        """One line: name, apps and where they go."""
        apps = ", ".join(
            f"{app} -> {' '.join(ts) if ts else '(nowhere)'}"
            for app, ts in self.meta.deploy_map.items()
        )
        sites = ALL_SITES if self.deploys_to_all else ", ".join(self.sites)
        return f"job {self.meta.name!r}: apps {apps}; sites {sites}"

    def to_zip(self, out: BinaryIO | Path | None = None) -> bytes | None:
        """The normalised archive: meta.json rewritten canonically, files in name order."""
        meta = meta_json(self.meta)
        members: list[tuple[str, Callable[[], bytes]]] = [(META_FILE, lambda: meta)]
        members += [(n, _reader(self.files, n)) for n in self.files.names()]
        return write_zip(members, out)


def _reader(files: JobFiles, name: str) -> Callable[[], bytes]:
    return lambda: files.read(name)


def meta_json(meta: JobMeta) -> bytes:
    """meta.json as fedhive writes it: the typed fields plus the kept unknown keys, sorted."""
    values: dict[str, Any] = {
        "name": meta.name,
        "resource_spec": meta.resource_spec,
        "deploy_map": meta.deploy_map,
        "mandatory_clients": meta.mandatory_clients,
    }
    if meta.min_clients is not None:
        values["min_clients"] = meta.min_clients
    values.update(meta.extra)
    return json.dumps(values, indent=2, sort_keys=True).encode() + b"\n"


def load_job(source: Path | bytes, limits: ArchiveLimits | None = None) -> JobDefinition:
    """Load and validate a job folder, zip file or zip bytes; raise with every violation."""
    limits = limits or ArchiveLimits()
    if isinstance(source, Path) and source.is_dir():
        return _validate(*_job_layout(folder_files(source, limits), source.name, False))
    if isinstance(source, Path) and not source.exists():
        raise InvalidJobDefinition([f"{clip(str(source), quote=False)}: no such file or folder"],
                                   field="path")
    files = zip_files(source, limits)
    hint = source.stem if isinstance(source, Path) else _DEFAULT_NAME
    return _validate(*_job_layout(files, hint, True))


def _job_layout(
    files: JobFiles, hint: str, zipped: bool
) -> tuple[JobFiles, dict[str, Any] | None, str]:
    """Find the job root (a zip may hold it in one top folder) and wrap a single app.

    Returns the files as laid out in the job, the generated meta (None: use meta.json) and the
    name to use where the job gives none.
    """
    top = files.top_level()
    at_root = bool(documents.find(files, documents.META)) or files.has_dir("config")
    if zipped and not at_root and len(top) == 1:
        (folder,) = top
        if files.has_dir(folder):
            files, hint = files.subtree(folder), folder
    if documents.find(files, documents.META) or not files.has_dir("config"):
        return files, None, hint
    app = hint if APP_NAME.match(hint) else "app"
    generated = {
        "name": app,
        "resource_spec": {},
        "deploy_map": {app: [ALL_SITES]},
        "min_clients": 1,
        "mandatory_clients": [],
    }
    return files.nested(app), generated, hint


def _validate(files: JobFiles, raw: dict[str, Any] | None, hint: str) -> JobDefinition:
    meta_file = None
    if raw is None:
        meta_file, raw, used = _read_meta(files, hint)
    else:
        used = 0
    name = raw.get("name", hint)
    checker = Checker(name if isinstance(name, str) and name.strip() else hint)
    checker.text_form_bytes = used
    meta = checker.meta(raw, hint)
    deploy_map = meta.deploy_map if meta else _usable_deploy_map(raw)
    configs = checker.apps(files, deploy_map)
    if meta is None or checker.violations:
        raise InvalidJobDefinition(checker.violations, field=checker.first_field)
    return JobDefinition(meta, configs, files.without(meta_file) if meta_file else files)


def _read_meta(files: JobFiles, hint: str) -> tuple[str, dict[str, Any], int]:
    """The meta file's name, its content parsed (in whichever form it is written) and the
    HOCON/YAML bytes that cost; refused unread when larger than MAX_META_FILE_BYTES (or, in
    HOCON or YAML, MAX_TEXT_FORM_BYTES)."""
    checker = Checker(hint)
    found = documents.find(files, documents.META)
    if len(found) != 1:
        if found:
            checker.add(found[0], documents.two_forms(found))
        else:
            checker.add(META_FILE, "is missing (and there is no config/ folder of a single app)")
        raise InvalidJobDefinition(checker.violations, field=checker.first_field)
    name = found[0]
    raw = checker.document(files, name, limits.MAX_META_DEPTH, limits.MAX_META_FILE_BYTES)
    if raw is None:
        raise InvalidJobDefinition(checker.violations, field=checker.first_field)
    return name, raw, checker.text_form_bytes


def _usable_deploy_map(raw: dict[str, Any]) -> dict[str, list[str]]:
    """The well-typed part of a deploy_map that failed other checks, to check its folders too."""
    value = raw.get("deploy_map")
    if not isinstance(value, dict):
        return {}
    flat = {app: deploy_targets(targets) for app, targets in value.items()}
    return {
        app: [ALL_SITES if t.upper() == ALL_SITES else t for t in targets if isinstance(t, str)]
        for app, targets in flat.items()
        if isinstance(app, str) and targets is not None
    }
