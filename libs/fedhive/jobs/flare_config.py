"""A parsed app config as fedhive builds it: FLARE's paths mapped, FLARE's variables resolved.

`translate_config` is the one step between parsing a config (any form, `fedhive.jobs.formats`)
and checking or building its components: the job validation runs it, and so do the server job
and the client job before they build anything, so a config that validates is the config that
starts. It

1. resolves FLARE's variable references (`"{app_script}"`): a top-level string, number or
   boolean of the config is a variable; a string that is exactly `{name}` becomes its value (of
   its type), `{name}` inside a longer string its text, as FLARE's configurator does;
2. refuses non-empty `task_data_filters` / `task_result_filters` (FLARE filters do not run in
   fedhive: silently skipping one, e.g. a privacy filter, would change what leaves a site);
3. drops components marked `"disabled": true` (FLARE skips them), maps every `nvflare.` path
   through `fedhive.jobs.flare_paths.TABLE` (FLARE's `"name": "ScatterAndGather"` form too),
   in `components`, `workflows`, `executors` and in arguments that are components themselves,
   and drops the components fedhive needs no object for;
4. refuses what is left referring to FLARE's system variables (`{SITE_NAME}`, `{WORKSPACE}`,
   ...), to the environment (`{$NAME}`) or to parameterized definitions (`{@def:...}`): fedhive
   sets none of them.

Configs without any of that come back unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fedhive.jobs.components import component_label
from fedhive.jobs.custom_code import CustomCode
from fedhive.jobs.flare_paths import BY_NAME, TABLE, Absorbed, is_flare, map_component
from fedhive.text import clip

Problem = tuple[str, str]  # (field, message)
FILTERS = ("task_data_filters", "task_result_filters")
SYSTEM_VARS = ("SITE_NAME", "WORKSPACE", "ROOT_URL", "SECURE_MODE", "JOB_ID", "CP_URL",
               "RELAY_URL")
MAX_RESOLVED = 64 * 1024  # characters of a string after its variables are filled in
_REF = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SIMPLE = re.compile(r"^\s*\{([A-Za-z_][A-Za-z0-9_]*)\}\s*$")
_UNSET = re.compile(r"\{(\$[A-Za-z_][A-Za-z0-9_]*|@[^}]*|" + "|".join(SYSTEM_VARS) + r")\}")
_ROUNDS = 20  # FLARE's bound on variables referring to variables
_DROP = object()


@dataclass(frozen=True)
class Translation:
    config: dict[str, Any]
    problems: list[Problem]


def translate_config(config: Mapping[str, Any], file: str,
                     custom: CustomCode | None = None) -> Translation:
    """`config` as fedhive builds it, and every problem found (field, message); `custom` (the
    app's code, at validation) lets the scripts FLARE's client API executors name be checked."""
    problems: list[Problem] = []
    resolved = _resolve_variables(config, file, problems)
    for name in FILTERS:
        filters = resolved.get(name)
        if filters not in (None, []):
            problems.append((f"{file} {name}", "FLARE filters do not run in fedhive, and "
                             "skipping one (a privacy filter) would change what leaves a site; "
                             "remove them, or transform the data in the trainer"))
    translator = _Translator(resolved, file, custom, problems)
    out = dict(resolved)
    for section in ("components", "workflows"):
        entries = resolved.get(section)
        if isinstance(entries, list):
            out[section] = [kept for index, entry in enumerate(entries)
                            if (kept := translator.entry(entry, f"{section}[{index}]",
                                                         section)) is not _DROP]
    entries = resolved.get("executors")
    if isinstance(entries, list):
        out["executors"] = [kept for index, entry in enumerate(entries)
                            if (kept := translator.executor(entry, index)) is not _DROP]
    for where, text in _strings({k: out[k] for k in ("components", "workflows", "executors")
                                 if k in out}):
        found = _UNSET.search(text)
        if found is not None:
            problems.append((f"{file} {where}", _unset_problem(found.group(1))))
    return Translation(out, problems)


def _unset_problem(name: str) -> str:
    if name.startswith("$"):
        return (f"refers to the environment variable {clip(name[1:], quote=False)}: fedhive "
                "does not put a site's environment into a job's config; write the value out")
    if name.startswith("@"):
        return ("refers to a parameterized definition {@...}, which fedhive does not expand; "
                "write the component out")
    return (f"refers to FLARE's system variable {name}, which fedhive does not set; write the "
            "value out")


class _Translator:
    def __init__(self, config: Mapping[str, Any], file: str, custom: CustomCode | None,
                 problems: list[Problem]) -> None:
        self.file = file
        self.custom = custom
        self.problems = problems
        components = config.get("components")
        self.by_id: dict[str, Mapping[str, Any]] = {
            c["id"]: c for c in (components if isinstance(components, list) else [])
            if isinstance(c, dict) and isinstance(c.get("id"), str)}

    # flare_paths.Context
    def component(self, cid: Any) -> Mapping[str, Any] | None:
        return self.by_id.get(cid) if isinstance(cid, str) else None

    def first_with(self, *paths: str) -> str | None:
        return next((cid for cid, c in self.by_id.items() if c.get("path") in paths), None)

    def script_problem(self, script: str) -> str | None:
        return self.custom.script_problem(script) if self.custom is not None else None

    def executor(self, entry: Any, index: int) -> Any:
        if not isinstance(entry, dict) or not isinstance(entry.get("executor"), dict):
            return entry  # its shape is check_components' to report
        where = f"executors[{index}].executor"
        executor = self.entry(entry["executor"], where, "executors")
        return _DROP if executor is _DROP else {**entry, "executor": executor}

    def entry(self, spec: Any, where: str, section: str) -> Any:
        """The spec mapped, or _DROP (disabled, absorbed, or refused: the problem is kept)."""
        if not isinstance(spec, dict):
            return spec
        if spec.get("disabled") is True:
            return _DROP
        field = f"{self.file} {component_label(spec, where)}"
        if "path" not in spec and isinstance(spec.get("name"), str):
            path = BY_NAME.get(spec["name"])
            if path is None:
                self.problems.append((field, f"name {clip(spec['name'])}: fedhive finds a class "
                                             "by its 'path' (the import path) only"))
                return _DROP
            spec = {**{k: v for k, v in spec.items() if k != "name"}, "path": path}
        if is_flare(spec.get("path")):
            mapped, problems = map_component(spec, self)
            self.problems.extend((field, problem) for problem in problems)
            if problems:
                return _DROP
            if mapped is None:
                if section != "components":
                    entry = TABLE.get(spec["path"])
                    why = entry.why if isinstance(entry, Absorbed) else ""
                    self.problems.append((field, f"{spec['path']} cannot be one of the "
                                                 f"{section} ({why})"))
                return _DROP
            spec = mapped
        args = spec.get("args")
        if not isinstance(args, dict):
            return spec
        nested = {}
        for name, value in args.items():
            if isinstance(value, dict) and "path" in value:
                value = self.entry(value, f"{where}.args.{name}", "arguments")
                if value is _DROP:
                    continue
            nested[name] = value
        return {**spec, "args": nested}


def _resolve_variables(config: Mapping[str, Any], file: str,
                       problems: list[Problem]) -> dict[str, Any]:
    variables = {k: v for k, v in config.items() if type(v) in (str, int, float, bool)}
    if not variables or not any("{" in text for _, text in _strings(dict(config))):
        return dict(config)
    try:
        for _ in range(_ROUNDS):
            changed = False
            for name, value in variables.items():
                if isinstance(value, str):
                    new = _substitute(value, variables)
                    if new != value:
                        variables[name], changed = new, True
            if not changed:
                break
        else:
            problems.append((file, f"variables refer to each other more than {_ROUNDS} levels "
                                   "deep (or in a circle)"))
            return dict(config)
        circle = sorted(k for k, v in variables.items()
                        if isinstance(v, str) and any(m.group(1) in variables
                                                      for m in _REF.finditer(v)))
        if circle:
            problems.append((file, f"variables {', '.join(circle)} refer to each other in a "
                                   "circle"))
            return dict(config)
        return {k: variables[k] if k in variables else _fill(v, variables)
                for k, v in config.items()}
    except _TooLong as err:
        problems.append((file, str(err)))
        return dict(config)


class _TooLong(ValueError):
    pass


def _substitute(text: str, variables: Mapping[str, Any]) -> Any:
    simple = _SIMPLE.match(text)
    if simple is not None and simple.group(1) in variables:
        return variables[simple.group(1)]
    new = _REF.sub(lambda m: str(variables[m.group(1)]) if m.group(1) in variables
                   else m.group(0), text)
    if len(new) > MAX_RESOLVED:
        raise _TooLong(f"a value with its variables filled in is longer than {MAX_RESOLVED} "
                       f"characters: {clip(text)}")
    return new


def _fill(value: Any, variables: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        return _substitute(value, variables)
    if isinstance(value, dict):
        return {k: _fill(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, variables) for v in value]
    return value


def _strings(value: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """Every string in `value` with where it is (`components[2].args.token`)."""
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, str):
            yield at, item
        elif isinstance(item, dict):
            stack += [(f"{at}.{k}" if at else str(k), v) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(f"{at}[{i}]", v) for i, v in enumerate(item)]
