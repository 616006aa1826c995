"""Building the components an app config names: `{id, path: "python.import.path", args}`.

Used by the server job (components, workflows) and the client job (executors). `args` values
that are themselves `{path, args}` objects are built first; an entry with an `id` is kept in
`components` so others can name it. A FLARE path (`nvflare....`) is built as its fedhive
equivalent (`fedhive.jobs.flare_paths.TABLE`, the table the job validation applies): a config
loaded with `fedhive.jobs.documents.load_app_config` has them mapped already, with the
components they name resolved; one built on its own is mapped here, alone.
"""

from __future__ import annotations

import importlib
from typing import Any

from fedhive.jobs.flare_paths import is_flare, map_component


class ComponentError(Exception):
    """A component that cannot be built; the message names its id."""


def build_component(spec: Any, where: str, components: dict[str, Any]) -> Any:
    """The object a `{id, path, args}` entry describes; nested `{path, args}` values in args
    are built first. ComponentError naming the component on a bad path or argument."""
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        raise ComponentError(f"{where}: must be an object with a 'path'")
    label = f"component {spec['id']!r}" if spec.get("id") else where
    if is_flare(spec["path"]):
        mapped, problems = map_component(spec)
        if problems or mapped is None:
            raise ComponentError(f"{label}: " + ("; ".join(problems) or
                                 f"{spec['path']} has no object of its own in fedhive"))
        spec = mapped
    module_name, _, class_name = spec["path"].rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ComponentError(f"{label}: cannot import {spec['path']!r}: {err}") from None
    args = spec.get("args", {})
    if not isinstance(args, dict):
        raise ComponentError(f"{label}: args must be an object")
    built = {
        name: build_component(value, f"{label} arg {name!r}", components)
        if isinstance(value, dict) and "path" in value else value
        for name, value in args.items()
    }
    try:
        instance = target(**built)
    except TypeError as err:
        raise ComponentError(f"{label}: bad arguments for {spec['path']}: {err}") from None
    except Exception as err:
        raise ComponentError(
            f"{label}: {spec['path']} raised {type(err).__name__}: {err}") from err
    if spec.get("id"):
        components[spec["id"]] = instance
    return instance
