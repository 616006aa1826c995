"""How a site agent runs its client jobs: as processes (`Processes`: a site's agent, one client
job per job, in its own process group) or as threads of the agent's own process (`Threads`: a
light-site host, `fedhive-site-agent host`, many sites in one process for tests and benchmarks
at scale).

A thread runs the client-job module's `run_in_thread(args, env=, cwd=, log_file=, abort=)`,
which does what the module's process does and returns its exit code. Threads share what a
process would have of its own: the environment (a resource consumer's variables are reported,
not applied), signals, imported modules (jobs whose `custom/` modules share a name run the
first one's), and a stop that cannot be forced: `stop` sets the thread's abort event and waits
the grace period, but a task that never looks at it keeps its thread.
"""

from __future__ import annotations

import importlib
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import structlog

from . import process

log = structlog.get_logger()


class Running(Protocol):
    """A started client job."""

    pid: int  # its process (group), 0 for a thread
    pid_started: int | None

    def wait(self) -> int:
        """Block until it ends; its exit code (-N: killed by signal N)."""
        ...

    def stop(self, grace: float) -> bool:
        """Ask it to stop, force it after `grace` seconds where that is possible; True when it
        had to be forced."""
        ...


class Launcher(Protocol):
    def launch(self, module: str, args: Sequence[str], *, cwd: Path, env: Mapping[str, str],
               log_file: Path) -> Running: ...


class Processes:
    """`python -m module args...` in its own session, output appended to `log_file`."""

    def launch(self, module: str, args: Sequence[str], *, cwd: Path, env: Mapping[str, str],
               log_file: Path) -> Running:
        return _Process(process.spawn(module, args, cwd=cwd, env=env, log_file=log_file))


class _Process:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.pid_started = process.start_time(proc.pid)

    def wait(self) -> int:
        return self._proc.wait()

    def stop(self, grace: float) -> bool:
        return process.stop_group(self.pid, self.pid_started, grace)


RunInThread = Callable[..., int]


class Threads:
    """`module.run_in_thread(args, ...)` in a thread of this process."""

    def launch(self, module: str, args: Sequence[str], *, cwd: Path, env: Mapping[str, str],
               log_file: Path) -> Running:
        run: RunInThread = importlib.import_module(module).run_in_thread
        return _Thread(run, list(args), cwd=cwd, env=dict(env), log_file=log_file)


class _Thread:
    pid = 0
    pid_started: int | None = None

    def __init__(self, run: RunInThread, args: list[str], *, cwd: Path, env: dict[str, str],
                 log_file: Path) -> None:
        self._abort = threading.Event()
        self._code = -signal.SIGKILL  # what a thread that died without returning counts as

        def target() -> None:
            self._code = run(args, env=env, cwd=cwd, log_file=log_file, abort=self._abort)

        self._thread = threading.Thread(target=target, name=f"client-job.{cwd.name}",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> int:
        self._thread.join()
        return self._code

    def stop(self, grace: float) -> bool:
        self._abort.set()
        self._thread.join(grace)
        if self._thread.is_alive():
            log.warning("client_job.thread_not_stopped", grace_s=grace,
                        why="a thread cannot be killed: it ends when its task returns")
        return False
