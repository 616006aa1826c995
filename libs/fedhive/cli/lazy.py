"""A command group that imports a command's module only when that command runs.

Every `fedhive` command used to import every other: grpc and the SDK, the POC's broker and
process code, rich's progress bars, so `fedhive --help` and `fedhive version` cost 0.8-1.0 s of
CPU (0.35 s now) and every admin command paid it before its own work. `LazyGroup` (Click's
lazy-loading pattern, on typer's group) holds, per command, where it is (`"module:attribute"`,
a function or a typer app) and the one line `fedhive --help` shows for it; the help listing
uses those lines, so it imports nothing. tests/unit/test_cli.py checks that each line is its
command's own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

import typer
import typer.main
from typer.core import TyperGroup


class LazyGroup(TyperGroup):
    """Subclass it with `lazy`: {name: ("module:attribute", one-line help)}, in help order.
    Until a command is loaded, the group holds a stand-in carrying its line (what the help
    listing and typer's "did you mean" read)."""

    lazy: ClassVar[dict[str, tuple[str, str]]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stand_ins = {name: command_of(name, _stand_in, help=line)
                     for name, (_, line) in self.lazy.items()}
        self.commands = {**stand_ins, **self.commands}
        self._unloaded = set(self.lazy)
        self._listing = False

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name in self._unloaded and not self._listing:
            self.commands[cmd_name] = load(cmd_name, self.lazy[cmd_name][0])
            self._unloaded.discard(cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


def load(name: str, target: str) -> Any:
    """The click command of `target` ("module:attribute": a typer app or a command function)."""
    module, _, attribute = target.partition(":")
    found = getattr(importlib.import_module(module), attribute)
    if isinstance(found, typer.Typer):
        command = typer.main.get_command(found)
        command.name = name
        return command
    return command_of(name, found)


def command_of(name: str, function: Callable[..., Any], **options: Any) -> Any:
    """`function` as the click command typer makes of it."""
    app = typer.Typer()
    app.command(name, **options)(function)
    return typer.main.get_command(app)


def _stand_in() -> None:
    """Stands for a command not loaded yet; never runs (`get_command` loads the real one)."""
