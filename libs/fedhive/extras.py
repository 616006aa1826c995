"""The optional parts of fedhive and the pip extra that installs each (pyproject.toml's
`[project.optional-dependencies]`): a bare `pip install fedhive` has none of them, so whatever
needs one checks first and says, in one line, what to install."""

from __future__ import annotations

import importlib.util

from fedhive.errors import ConfigError

# module -> (the package that provides it, the fedhive extra that installs it)
PROVIDERS = {
    "torch": ("torch", "torch"),
    "sklearn": ("scikit-learn", "torch"),
    "matplotlib": ("matplotlib", "plot"),
}


def missing(*modules: str) -> list[str]:
    """The `modules` that cannot be imported here."""
    return [module for module in modules if importlib.util.find_spec(module) is None]


def needs(what: str, modules: list[str]) -> str:
    """The line saying that `what` needs `modules` and which extra installs them."""
    packages = " and ".join(PROVIDERS[module][0] for module in modules)
    extras = ",".join(dict.fromkeys(PROVIDERS[module][1] for module in modules))
    return f"{what} needs {packages}: pip install 'fedhive[{extras}]'"


def require(what: str, *modules: str) -> None:
    """ConfigError naming the packages and the extra when any of `modules` is not installed."""
    absent = missing(*modules)
    if absent:
        raise ConfigError(needs(what, absent), field=PROVIDERS[absent[0]][0])
