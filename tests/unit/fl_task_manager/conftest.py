"""Fixtures of the task manager's tests: a fake clock and a task manager of three sites on it."""

from __future__ import annotations

import pytest

from fedhive.fl.task_manager import TaskManager

from .support import SITES, Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tm(clock: Clock) -> TaskManager:
    return TaskManager(SITES, clock=clock)
