"""Resources as named lists of units, e.g. `{"gpu": [0, 1, 2, 3], "port": [9000, 9001]}`.

A requirement `{"gpu": 2}` reserves two units of that list; the allocation lists the units
(`{"gpu": [0, 1]}`), so GPUResourceConsumer can turn a "gpu" list into CUDA_VISIBLE_DEVICES.
Free units are handed out in the configured order, lowest position first.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fedhive.errors import ConfigError
from fedhive.resources.auto_clean import DEFAULT_EXPIRATION_S, AutoCleanResourceManager, Clock
from fedhive.resources.requirements import count_problem, unknown_key
from fedhive.resources.spec import Requirement

Unit = int | str


class ListResourceManager(AutoCleanResourceManager):
    def __init__(
        self,
        resources: dict[str, list[Unit]],
        *,
        expiration_period: float = DEFAULT_EXPIRATION_S,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(expiration_period=expiration_period, clock=clock)
        self._units = _validated(resources)
        self._position = {
            kind: {unit: i for i, unit in enumerate(units)} for kind, units in self._units.items()
        }
        self._pool = {kind: list(units) for kind, units in self._units.items()}

    def _invalid(self, requirement: Requirement) -> str | None:
        if (reason := unknown_key(requirement, self._units)) is not None:
            return reason
        for kind, count in requirement.items():
            if (reason := count_problem(kind, count)) is not None:
                return reason
        return None

    def _shortfall(self, requirement: Requirement) -> str | None:
        for kind, count in sorted(requirement.items()):
            if count > len(self._units[kind]):
                return f"{kind} {count} > {len(self._units[kind])} on this site"
            if count > len(self._pool[kind]):
                return f"{kind} {count} > {len(self._pool[kind])} free"
        return None

    def _take(self, requirement: Requirement) -> dict[str, Any]:
        held: dict[str, Any] = {}
        for kind, count in requirement.items():
            if count:
                held[kind], self._pool[kind] = self._pool[kind][:count], self._pool[kind][count:]
        return held

    def _put_back(self, held: dict[str, Any]) -> None:
        for kind, units in held.items():
            position = self._position[kind]
            self._pool[kind] = sorted([*self._pool[kind], *units], key=lambda u: position[u])

    def _claim(self, held: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        for kind, units in held.items():
            if kind not in self._units:
                return {}, f"unknown resource {kind!r} (known: {', '.join(sorted(self._units))})"
            if not isinstance(units, list) or not units or not all(_is_unit(u) for u in units):
                return {}, f"{kind!r} must be a non-empty list of units, got {units!r}"
            if len(set(units)) != len(units):
                return {}, f"it lists a {kind} unit twice: {units!r}"
            for unit in units:
                if unit not in self._position[kind]:
                    return {}, f"{kind} unit {unit!r} is not on this site"
                if unit not in self._pool[kind]:
                    return {}, f"{kind} unit {unit!r} is not free"
        for kind, units in held.items():
            self._pool[kind] = [u for u in self._pool[kind] if u not in units]
        return {kind: list(units) for kind, units in held.items()}, None

    def _totals(self) -> dict[str, Any]:
        return {kind: len(units) for kind, units in self._units.items()}

    def _free(self) -> dict[str, Any]:
        return {kind: len(units) for kind, units in self._pool.items()}


def _is_unit(value: object) -> bool:
    return isinstance(value, int | str) and not isinstance(value, bool)


def _validated(resources: object) -> dict[str, list[Unit]]:
    if not isinstance(resources, dict):
        raise ConfigError(
            f"resources must be a dict of name -> list of units, got {resources!r}",
            field="resources",
        )
    checked: dict[str, list[Unit]] = {}
    for kind, units in resources.items():
        field = f"resources.{kind}"
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"resource name {kind!r} must be a non-empty string", field=field)
        if not isinstance(units, list) or not all(_is_unit(u) for u in units):
            raise ConfigError(
                f"{field} must be a list of integers or strings, got {units!r}", field=field
            )
        if len(set(units)) != len(units):
            # A repeated unit could be handed to two jobs at once.
            raise ConfigError(f"{field} lists a unit twice: {units!r}", field=field)
        checked[kind] = list(units)
    return checked
