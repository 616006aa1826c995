"""What every service's `main()` shares: settings, logging, signals, a bounded heap
(`fedhive.heap`) and a clean shutdown.

A service's composition root is a `build(settings, log)` function that creates its ports and
consumers, starts them and returns a `Service`: something with `close()` and `ready_checks()`,
the readiness checks of what it really uses (`fedhive.readiness_checks`). `run()` calls it,
runs those checks every few seconds into the service's readiness file (`fedhive.readiness`;
a service that also has `readiness_changed(ready)` is told of each change), then waits for
SIGTERM or SIGINT and closes both. A `FedhiveError` at start (bad settings, bad config file)
ends the process with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol, runtime_checkable

from fedhive.config import Settings
from fedhive.errors import FedhiveError
from fedhive.heap import bound_heap
from fedhive.logging import configure
from fedhive.readiness import Check, Readiness, ReadyConfig


class Service(Protocol):
    def close(self) -> None: ...

    def ready_checks(self) -> Sequence[Check]: ...


@runtime_checkable
class FollowsReadiness(Protocol):
    def readiness_changed(self, ready: bool) -> None: ...


def run(
    service: str,
    build: Callable[[Settings, Any], Service],
    *,
    settings: Settings | None = None,
) -> NoReturn:
    """Run a service until SIGTERM/SIGINT; exit 0 after a clean shutdown, 2 if it cannot start."""
    bound_heap()  # before `build` starts any thread
    try:
        settings = settings or Settings.from_env()
        log = configure(service, level=settings.log_level, json=True)
        stop = threading.Event()
        ready_config = ReadyConfig.for_service(service, settings)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        running = build(settings, log)
        try:
            readiness = _start_readiness(service, running, ready_config, log)
        except BaseException:
            running.close()
            raise
    except FedhiveError as err:
        print(f"{service}: {err}", file=sys.stderr)
        sys.exit(2)
    log.info("service.started")
    # Python runs handlers on the main thread only, and a signal the kernel hands another
    # thread (a fenced job-runner signals itself from its lease thread) does not wake a
    # blocked wait: waking now and then is what lets the handler run at all.
    while not stop.wait(timeout=1.0):
        pass
    log.info("service.stopping")
    readiness.close()
    running.close()
    log.info("service.stopped")
    sys.exit(0)


def _start_readiness(service: str, running: Service, config: ReadyConfig, log: Any) -> Readiness:
    follows = running.readiness_changed if isinstance(running, FollowsReadiness) else None
    readiness = Readiness(service, running.ready_checks(), config, log, on_change=follows)
    try:
        readiness.start()
    except BaseException:
        readiness.close()
        raise
    return readiness


def positive_seconds(text: str) -> float:
    """An argparse `type` for durations and intervals: a number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be positive")
    return value


def count(text: str) -> int:
    """An argparse `type` for counts: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value
