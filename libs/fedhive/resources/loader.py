"""Build a site's resource manager and consumer from its `local/resources.json`.

The file has FLARE's format: `{"components": [{"id": "resource_manager", "path":
"python.import.Path", "args": {...}}, {"id": "resource_consumer", ...}]}`; other top-level keys
and other components are left to their own readers. Any class implementing the spec can be
named by import path. FLARE's paths of the managers and consumer fedhive re-implements are
accepted too, so a FLARE site's resources.json works unchanged (FLARE-only arguments such as
`ignore_host` are refused by name, like any unknown argument).

Every problem is a `ConfigError` whose one-line message names the file, the component and the
field or argument, raised before anything is built: a site must not start half-configured.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from fedhive.errors import ConfigError
from fedhive.resources.spec import ResourceConsumerSpec, ResourceManagerSpec

MANAGER_ID = "resource_manager"
CONSUMER_ID = "resource_consumer"

FLARE_PATHS = {
    "nvflare.app_common.resource_managers.gpu_resource_manager.GPUResourceManager": (
        "fedhive.resources.gpu.GPUResourceManager"
    ),
    "nvflare.app_common.resource_managers.list_resource_manager.ListResourceManager": (
        "fedhive.resources.listed.ListResourceManager"
    ),
    "nvflare.app_common.resource_consumers.gpu_resource_consumer.GPUResourceConsumer": (
        "fedhive.resources.gpu.GPUResourceConsumer"
    ),
}

T = TypeVar("T")
log = structlog.get_logger()


@dataclass(frozen=True)
class SiteResources:
    manager: ResourceManagerSpec
    consumer: ResourceConsumerSpec


def load_resources(path: Path) -> SiteResources:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read: {err}", field=path.name) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(
            f"{path}: invalid JSON at line {err.lineno} column {err.colno}: {err.msg}",
            field=path.name,
        ) from None
    return build_resources(config, source=str(path))


def build_resources(config: object, *, source: str = "resources.json") -> SiteResources:
    """`config` is the parsed resources.json; `source` names it in error messages."""
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: must be a JSON object", field=Path(source).name)
    components = config.get("components")
    if not isinstance(components, list):
        raise ConfigError(f"{source}: 'components' must be a list", field="components")
    found: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for index, component in enumerate(components):
        where = f"components[{index}]"
        if not isinstance(component, dict):
            raise ConfigError(f"{source}: {where} must be an object", field=where)
        cid = component.get("id")
        if not isinstance(cid, str):
            raise ConfigError(f"{source}: {where}.id must be a string", field=f"{where}.id")
        if cid in found:
            raise ConfigError(
                f"{source}: component {cid!r} appears twice ({found[cid][0]} and {where})",
                field=f"{where}.id",
            )
        found[cid] = (where, component)
    for cid in (MANAGER_ID, CONSUMER_ID):
        if cid not in found:
            raise ConfigError(f"{source}: no component with id {cid!r}", field="components")
    # mypy refuses abstract classes as type[T] arguments (python/mypy#4717); they are only
    # used for issubclass here.
    manager_spec: type[ResourceManagerSpec] = ResourceManagerSpec  # type: ignore[type-abstract]
    consumer_spec: type[ResourceConsumerSpec] = ResourceConsumerSpec  # type: ignore[type-abstract]
    return SiteResources(
        manager=build_component(*found[MANAGER_ID], manager_spec, source=source),
        consumer=build_component(*found[CONSUMER_ID], consumer_spec, source=source),
    )


def build_component(where: str, component: Mapping[str, Any], spec: type[T], *, source: str) -> T:
    """Import the class at `component["path"]`, check it implements `spec` and that `args` fit
    its constructor, then build it. `where` (e.g. "components[0]") names it in errors."""
    prefix = f"{source}: component {component.get('id')!r}"
    cls = _import_class(component.get("path"), f"{prefix} ({where}.path)", f"{where}.path")
    if not issubclass(cls, spec):
        raise ConfigError(
            f"{prefix}: {_name(cls)} does not implement {spec.__name__}", field=f"{where}.path"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ConfigError(
            f"{prefix}: {_name(cls)} is abstract (does not implement {missing})",
            field=f"{where}.path",
        )
    args = component.get("args", {})
    if not isinstance(args, dict):
        raise ConfigError(f"{prefix}: {where}.args must be an object", field=f"{where}.args")
    _check_args(cls, args, prefix, f"{where}.args")
    try:
        built = cls(**args)
    except ConfigError as err:
        field = f"{where}.args.{err.field}" if err.field else f"{where}.args"
        raise ConfigError(f"{prefix}: {err.message}", field=field) from err
    except Exception as err:  # a third-party class may raise anything on bad arguments
        raise ConfigError(
            f"{prefix}: {_name(cls)}(**args) failed: {type(err).__name__}: {err}",
            field=f"{where}.args",
        ) from err
    return built


def _import_class(path: object, prefix: str, field: str) -> type[Any]:
    if not isinstance(path, str) or "." not in path.strip("."):
        raise ConfigError(f"{prefix}: must be a dotted import path, got {path!r}", field=field)
    if path in FLARE_PATHS:
        log.info("resources.flare_path", path=path, using=FLARE_PATHS[path])
        path = FLARE_PATHS[path]
    module_name, _, attribute = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raises while importing
        raise ConfigError(
            f"{prefix}: cannot import module {module_name!r}: {type(err).__name__}: {err}",
            field=field,
        ) from err
    cls = getattr(module, attribute, None)
    if cls is None:
        raise ConfigError(f"{prefix}: module {module_name!r} has no {attribute!r}", field=field)
    if not isinstance(cls, type):
        raise ConfigError(f"{prefix}: {path!r} is not a class", field=field)
    return cls


def _check_args(cls: type[Any], args: Mapping[str, Any], prefix: str, field: str) -> None:
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{prefix}: cannot inspect {_name(cls)}: {err}", field=field) from err
    by_keyword = {
        p.name: p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    accepted = ", ".join(by_keyword) or "none"
    for name in args:
        if name not in by_keyword and not takes_any:
            raise ConfigError(
                f"{prefix}: {_name(cls)} has no argument {name!r} (accepted: {accepted})",
                field=f"{field}.{name}",
            )
    for parameter in parameters:
        required = parameter.default is inspect.Parameter.empty and parameter.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if required and parameter.name not in args:
            raise ConfigError(
                f"{prefix}: {_name(cls)} needs argument {parameter.name!r}",
                field=f"{field}.{parameter.name}",
            )


def _name(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
