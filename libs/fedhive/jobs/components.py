"""Components of an app config (`{id, path, args}`), checked before the job is stored.

A config lists `components` and `workflows` (server) and `executors` (`{tasks, executor}`,
site); args may nest further components. The config checked is the translated one
(`fedhive.jobs.flare_config`: FLARE's `nvflare.` paths are fedhive's by then, or refused).
A path under `fedhive.` is resolved here: the class must exist and the args must fit its
constructor (unknown names and missing required ones are both errors), so a typo fails at
submission instead of at run time on every site. A path whose top module is in the app's
`custom/` folder must name a module there that defines the name (read with `ast`, never
imported: `fedhive.jobs.custom_code`). Any other path may be a library installed where the app
runs: it is only checked for shape, and never imported by a control-plane service.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator, Mapping
from typing import Any

from fedhive.jobs.custom_code import CustomCode
from fedhive.text import clip

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$")
_OWN_PACKAGE = "fedhive"
_FLARE_PACKAGE = "nvflare"

Problem = tuple[str, str]  # (field, message)


def check_components(config: Mapping[str, Any], file: str,
                     custom: CustomCode | None = None) -> list[Problem]:
    """All problems with the components declared in one parsed (and translated) config file;
    `custom`: the app's code, when its files are at hand."""
    problems: list[Problem] = []
    ids: dict[str, int] = {}
    for where, component in _declared(config, file, problems):
        label = component_label(component, where)
        cid = component.get("id")
        if isinstance(cid, str):
            ids[cid] = ids.get(cid, 0) + 1
        problems += [(f"{file} {label}", text)
                     for text in _component_problems(component, custom)]
    problems += [
        (f"{file} component {clip(cid)}", f"id used by {count} components")
        for cid, count in ids.items()
        if count > 1
    ]
    return problems


def _declared(
    config: Mapping[str, Any], file: str, problems: list[Problem]
) -> Iterator[tuple[str, dict[str, Any]]]:
    for section in ("components", "workflows", "executors"):
        entries = config.get(section, [])
        if not isinstance(entries, list):
            problems.append((f"{file} {section}", "must be a list"))
            continue
        for index, entry in enumerate(entries):
            where = f"{section}[{index}]"
            if section == "executors" and isinstance(entry, dict):
                entry = entry.get("executor")
                where += ".executor"
            if not isinstance(entry, dict):
                problems.append((f"{file} {where}", "must be an object with 'path' and 'args'"))
                continue
            yield where, entry
            yield from _nested(entry, where)


def _nested(component: dict[str, Any], where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Components given as argument values (`{"path": ..., "args": ...}` inside args)."""
    args = component.get("args")
    if not isinstance(args, dict):
        return
    for name, value in args.items():
        if isinstance(value, dict) and "path" in value:
            at = f"{where}.args.{_name(name)}"
            yield at, value
            yield from _nested(value, at)


def component_label(component: Mapping[str, Any], where: str) -> str:
    """How a message names a component: by its id, else by where it is in the config."""
    cid = component.get("id")
    return f"component {clip(cid)}" if isinstance(cid, str) and cid else f"component at {where}"


def _name(name: str) -> str:
    """An argument name as a message shows it."""
    return clip(name, quote=False)


def _component_problems(component: Mapping[str, Any], custom: CustomCode | None) -> list[str]:
    cid = component.get("id")
    if cid is not None and not (isinstance(cid, str) and cid):
        return ["id must be a non-empty string"]
    path = component.get("path")
    if not isinstance(path, str) or not _DOTTED.match(path):
        return [f"path must be a dotted Python class path, got {clip(path)}"]
    args = component.get("args", {})
    if not isinstance(args, dict):
        return ["args must be an object"]
    top = path.split(".", 1)[0]
    if top == _FLARE_PACKAGE:  # translation maps or refuses these; a config not translated
        return [f"{clip(path, quote=False)} is FLARE's: the config must be translated first"]
    if top != _OWN_PACKAGE:  # custom/ code (checked when at hand) or a site library
        problem = custom.class_problem(path) if custom is not None else None
        return [] if problem is None else [f"path {clip(path)}: {problem}"]
    return _fedhive_class_problems(path, set(args))


def _fedhive_class_problems(path: str, arg_names: set[str]) -> list[str]:
    module_name, _, class_name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return [f"unknown fedhive class {clip(path)}: no module {clip(module_name)}"]
    cls = getattr(module, class_name, None)
    if not inspect.isclass(cls):
        return [f"unknown fedhive class {clip(path)}"]
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []  # a constructor without an inspectable signature: cannot judge the args
    named = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    problems = []
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = sorted(arg_names - set(named))
        if unknown:
            problems.append(f"{path} takes no argument(s) {', '.join(map(_name, unknown))}")
    missing = sorted(n for n, p in named.items() if p.default is p.empty and n not in arg_names)
    if missing:
        problems.append(f"{path} needs argument(s) {', '.join(missing)}")
    return problems
