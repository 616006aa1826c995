"""deploy/compose/'s scripts loaded as modules (deploy/ holds scripts, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "deploy" / "compose"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"compose_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


healthcheck = load_script("healthcheck")
broker_setup = load_script("broker_setup")
admins_file = load_script("admins_file")
