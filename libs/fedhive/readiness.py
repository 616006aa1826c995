"""Readiness: whether a service can do its work now, not only whether its process runs.

Each service's composition root declares its checks (`Check`: a name and a probe that returns
a detail, or raises saying why the dependency is not usable; `fedhive.readiness_checks` has the
real ones). `Readiness` runs them in one thread every `interval_s`, each probe bounded by
`timeout_s` (a hung Redis fails its check; it does not hang the loop), and writes the result
atomically (temporary file + rename) to a small JSON file:

    {"service": "job-store", "ready": false, "at": 1767000000.0, "interval_s": 5.0,
     "checks": {"broker": {"ok": true, "detail": "consuming from fedhive.job-store"},
                "redis": {"ok": false, "detail": "Error 111 connecting to ... refused."}}}

An exec probe (`deploy/compose/healthcheck.py ready`, a Kubernetes exec probe, an ECS health
check) reads it without opening connections of its own: `verdict` says healthy only when it
says ready and is fresh (written within `STALE_AFTER` intervals: a dead or wedged process is
not ready). A file rather than an HTTP endpoint: no port to bind, secure or collide on, and
every orchestrator can run a command in the container.

The path is FEDHIVE_READY_FILE, else `<tmp>/fedhive-<service>.ready`; FEDHIVE_READY_INTERVAL
sets the interval (both read by `fedhive.config`). This module stays light (the standard
library and the settings): the probe imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhive.config import Settings
from fedhive.errors import ConfigError

DEFAULT_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 2.0
STALE_AFTER = 3  # intervals without a write after which the file no longer counts
_DETAIL_CHARS = 300


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Check:
    """`probe()` returns a short detail when the dependency is usable and raises (any
    exception, its message the reason) when not; `close()` releases what the probe holds."""

    name: str
    probe: Callable[[], str]
    close: Callable[[], None] = _nothing


@dataclass(frozen=True)
class Outcome:
    ok: bool
    detail: str


@dataclass(frozen=True)
class Report:
    service: str
    checks: Mapping[str, Outcome]
    at: float  # time.time() of the evaluation: the probe runs in another process
    interval_s: float

    @property
    def ready(self) -> bool:
        return all(outcome.ok for outcome in self.checks.values())

    def failing(self) -> str:
        """`name: detail` of each failing check, `; `-separated."""
        return "; ".join(f"{name}: {outcome.detail}" for name, outcome in self.checks.items()
                         if not outcome.ok)

    def to_json(self) -> dict[str, Any]:
        return {"service": self.service, "ready": self.ready, "at": self.at,
                "interval_s": self.interval_s,
                "checks": {name: {"ok": outcome.ok, "detail": outcome.detail}
                           for name, outcome in self.checks.items()}}

    @classmethod
    def from_json(cls, data: Any) -> Report:
        """ValueError when `data` is not a report."""
        try:
            checks = {str(name): Outcome(bool(value["ok"]), str(value["detail"]))
                      for name, value in data["checks"].items()}
            return cls(str(data["service"]), checks, float(data["at"]), float(data["interval_s"]))
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"not a readiness report ({type(err).__name__}: {err})") from None


def verdict(report: Report, now: float) -> tuple[bool, str]:
    """(healthy, one line saying why): ready and fresh, else what fails or how stale it is."""
    age = now - report.at
    if age > STALE_AFTER * report.interval_s:
        return False, (f"{report.service} readiness is stale: last written {age:.0f}s ago, "
                       f"every {report.interval_s:g}s expected (the process is dead or wedged)")
    if not report.ready:
        return False, f"{report.service} not ready: {report.failing()}"
    return True, f"{report.service} ready: {', '.join(report.checks) or 'no checks'}"


def read_report(path: Path) -> Report:
    """The report in `path`; FileNotFoundError when none, ValueError when not a report."""
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    try:
        return Report.from_json(data)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def write_report(path: Path, report: Report) -> None:
    """Atomically: a reader sees the previous report or this one, never a part."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(report.to_json()))
    os.replace(temporary, path)


@dataclass(frozen=True)
class ReadyConfig:
    path: Path
    interval_s: float = DEFAULT_INTERVAL_S

    @property
    def timeout_s(self) -> float:
        """Each probe's bound; never past the next round."""
        return min(DEFAULT_TIMEOUT_S, self.interval_s)

    @classmethod
    def for_service(cls, service: str, settings: Settings) -> ReadyConfig:
        """FEDHIVE_READY_FILE and FEDHIVE_READY_INTERVAL (`Settings`), else the defaults."""
        path = Path(settings.ready_file) if settings.ready_file else default_path(service)
        return cls(path, settings.ready_interval_s)


def default_path(service: str) -> Path:
    """Where `service` writes its readiness unless FEDHIVE_READY_FILE says otherwise."""
    return Path(tempfile.gettempdir()) / f"fedhive-{service.removeprefix('fedhive-')}.ready"


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _DETAIL_CHARS else line[:_DETAIL_CHARS - 3] + "..."


class _Call:
    """One probe call on a daemon thread of its own: a hung one must not block the exit."""

    def __init__(self, check: Check) -> None:
        self.started = time.monotonic()
        self.done = threading.Event()
        self.outcome = Outcome(False, "no answer")
        threading.Thread(target=self._run, args=(check,), name=f"readiness-{check.name}",
                         daemon=True).start()

    def _run(self, check: Check) -> None:
        try:
            self.outcome = Outcome(True, _one_line(check.probe()))
        except Exception as err:  # any failure is the check's answer
            self.outcome = Outcome(False, _one_line(str(err) or type(err).__name__))
        finally:
            self.done.set()


class Readiness:
    """Runs `checks` now (`start()`) and then every interval until `close()`. Logs the
    transitions only (`readiness.ready`, `readiness.not_ready`) and tells `on_change` of
    each; the file is rewritten every round so its age says the loop is alive."""

    def __init__(self, service: str, checks: Sequence[Check], config: ReadyConfig, log: Any,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self._service = service.removeprefix("fedhive-")
        self._checks = list(checks)
        self._config = config
        self._log = log
        self._on_change = on_change
        self._calls: dict[str, _Call] = {}  # a call still running is waited on, not repeated
        self._ready: bool | None = None
        self._write_failed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="readiness", daemon=True)

    def start(self) -> Report:
        """The first round, then the loop. ConfigError when the file cannot be written."""
        report = self._evaluate(first=True)
        self._thread.start()
        return report

    def evaluate(self) -> Report:
        """One round: run the checks, write the file, log and announce a transition."""
        return self._evaluate(first=False)

    def _evaluate(self, *, first: bool) -> Report:
        report = self._round()
        try:
            write_report(self._config.path, report)
            self._write_failed = False
        except OSError as err:
            if first:
                raise ConfigError(f"FEDHIVE_READY_FILE {self._config.path}: cannot write it "
                                  f"({err.strerror or err})", field="FEDHIVE_READY_FILE") from None
            if not self._write_failed:  # once per streak: the probe sees the file go stale
                self._log.error("readiness.write_failed", path=str(self._config.path),
                                error=str(err))
            self._write_failed = True
        self._announce(report)
        return report

    def close(self) -> None:
        """Stop the loop, release the checks' connections and remove the file: a stopped
        service is not ready."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for check in self._checks:
            with contextlib.suppress(Exception):
                check.close()
        with contextlib.suppress(OSError):
            self._config.path.unlink()

    def _round(self) -> Report:
        timeout = self._config.timeout_s
        for check in self._checks:
            call = self._calls.get(check.name)
            if call is None or call.done.is_set():
                self._calls[check.name] = _Call(check)
        deadline = time.monotonic() + timeout
        outcomes = {}
        for check in self._checks:
            call = self._calls[check.name]
            if call.done.wait(max(0.0, deadline - time.monotonic())):
                outcomes[check.name] = call.outcome
            else:
                hung = time.monotonic() - call.started
                outcomes[check.name] = Outcome(False, f"no answer for {hung:.1f}s "
                                                      f"(limit {timeout:g}s)")
        return Report(self._service, outcomes, time.time(), self._config.interval_s)

    def _announce(self, report: Report) -> None:
        if report.ready == self._ready:
            return
        self._ready = report.ready
        if report.ready:
            self._log.info("readiness.ready", checks=list(report.checks))
        else:
            self._log.warning("readiness.not_ready", failing=report.failing())
        if self._on_change is not None:
            self._on_change(report.ready)

    def _loop(self) -> None:
        while not self._stop.wait(self._config.interval_s):
            try:
                self.evaluate()
            except Exception as err:  # the loop must outlive any failure; the file goes stale
                self._log.error("readiness.round_failed", error=repr(err), exc_info=True)
