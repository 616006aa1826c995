"""Which fedhive process is which, and how much memory and CPU each uses during a benchmark.

`role_of` and `site_of` tell a process's role (client job, site agent, server job, trainer, a
service; SeaweedFS as "s3_server") and site from its command line; `owner_of` finds the
process behind a TCP connection (the byte-counting proxy labels connections with it).
`RssSampler` samples every fedhive process under the benchmark every 50 ms: per process its
peak RSS (samples and the kernel's VmHWM) and CPU seconds in the current window, and the peak
of the RSS summed over all of them; `by_role` and `cpu_by_role` summarise a window.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
from support import high_water_mb  # beside this script

MiB = 1024 * 1024
SAMPLE_S = 0.05
# Process roles by command line (the forked server job has its fork server's command line:
# a fork-server process whose parent is the fork server is a server job).
ROLES = (("trainer", "custom/train.py"),
         ("cj", "fedhive_services.site_agent.client_job"),
         ("site_agent", "fedhive_services.site_agent.main"),
         ("runner", "fedhive_services.job_runner.main"),
         ("job_store", "fedhive_services.job_store"),
         ("scheduler", "fedhive_services.scheduler"),
         ("resource_tracker", "multiprocessing.resource_tracker"))
FORK_SERVER = "multiprocessing.forkserver"


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def role_of(proc: psutil.Process) -> str | None:
    """The fedhive role of a process, None for anything else (SeaweedFS, the benchmark)."""
    command = _cmdline(proc)
    if command.split(" ", 1)[0].endswith("/weed"):  # SeaweedFS, started by bench_settings
        return "s3_server"
    if FORK_SERVER in command:
        try:
            parent = proc.parent()
        except psutil.Error:
            parent = None
        return "sj" if parent is not None and FORK_SERVER in _cmdline(parent) else "fork_server"
    return next((role for role, marker in ROLES if marker in command), None)


def site_of(proc: psutil.Process) -> str:
    """The site a process works for: the `--site-dir` of it or of an ancestor (site folders
    are named after their site), '' for none."""
    try:
        chain = [proc, *proc.parents()]
    except psutil.Error:
        return ""
    for member in chain:
        try:
            args = member.cmdline()
        except psutil.Error:
            continue
        if "--site-dir" in args[:-1]:
            return Path(args[args.index("--site-dir") + 1]).name
    return ""


def owner_of(peer: tuple[str, int], proxy: tuple[str, int]) -> str:
    """'site/role' of the process whose TCP socket goes from `peer` to `proxy`."""
    for _ in range(5):
        for conn in psutil.net_connections(kind="tcp4"):
            if (conn.pid and conn.laddr and conn.raddr and tuple(conn.laddr) == tuple(peer)
                    and tuple(conn.raddr) == tuple(proxy)):
                proc = psutil.Process(conn.pid)
                return f"{site_of(proc) or '-'}/{role_of(proc) or proc.name()}"
        time.sleep(0.02)
    return "unknown"


@dataclasses.dataclass
class ProcessPeak:
    role: str
    site: str
    peak_mb: float = 0.0
    cpu_s: float = 0.0  # CPU time (user + system) in the window
    cpu_base: float = 0.0


class RssSampler:
    """Every `interval` s: the RSS and CPU time of each fedhive process descending from this
    one (and of the S3 server, kept out of the totals); per process its peak RSS (samples and
    VmHWM) and CPU seconds in the window, and the peak of the RSS summed over all of them."""

    def __init__(self, interval: float = SAMPLE_S) -> None:
        self.interval = interval
        self._root = psutil.Process()
        self._lock = threading.Lock()
        self._known: dict[tuple[int, float], ProcessPeak | None] = {}
        self._peaks: dict[tuple[int, float], ProcessPeak] = {}
        self.total_peak_mb = 0.0
        self.total_peak_without_trainers_mb = 0.0
        self.samples = 0
        self._hwm_floor: dict[tuple[int, float], float] = {}  # processes older than the window
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def reset(self) -> None:
        """Start a new measurement window (peaks of processes still alive start over)."""
        with self._lock:
            self._peaks.clear()
            self.total_peak_mb = self.total_peak_without_trainers_mb = 0.0
            self.samples = 0
            self._hwm_floor = {key: 0.0 for key in self._known}

    def peaks(self) -> list[ProcessPeak]:
        with self._lock:
            return [dataclasses.replace(peak) for peak in self._peaks.values()]

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _classify(self, proc: psutil.Process, key: tuple[int, float]) -> ProcessPeak | None:
        if key not in self._known:
            role = role_of(proc)
            self._known[key] = None if role is None else ProcessPeak(role, site_of(proc))
        return self._known[key]

    def _sample(self) -> None:
        try:
            children = self._root.children(recursive=True)
        except psutil.Error:
            return
        total = without_trainers = 0.0
        with self._lock:
            for proc in children:
                try:
                    key = (proc.pid, proc.create_time())
                    info = self._classify(proc, key)
                    if info is None:
                        continue
                    rss = proc.memory_info().rss / MiB
                    times = proc.cpu_times()
                except psutil.Error:
                    continue
                cpu = times.user + times.system
                older = key in self._hwm_floor  # alive before the window began
                peak = self._peaks.get(key)
                if peak is None:
                    peak = self._peaks[key] = dataclasses.replace(info, cpu_base=cpu if older
                                                                  else 0.0)
                peak.cpu_s = cpu - peak.cpu_base
                # VmHWM counts from the process's start: only trusted in a window it began in
                hwm = high_water_mb(proc.pid) if not older else 0.0
                peak.peak_mb = max(peak.peak_mb, rss, hwm)
                if info.role == "s3_server":
                    continue
                total += rss
                if info.role != "trainer":
                    without_trainers += rss
            self.total_peak_mb = max(self.total_peak_mb, total)
            self.total_peak_without_trainers_mb = max(self.total_peak_without_trainers_mb,
                                                      without_trainers)
            self.samples += 1


def by_role(peaks: Sequence[ProcessPeak]) -> dict[str, float]:
    """role -> the largest peak of a process in that role (MiB)."""
    found: dict[str, float] = {}
    for peak in peaks:
        found[peak.role] = round(max(found.get(peak.role, 0.0), peak.peak_mb), 1)
    return dict(sorted(found.items()))


def cpu_by_role(peaks: Sequence[ProcessPeak]) -> dict[str, float]:
    """role -> CPU seconds of all its processes in the window."""
    found: dict[str, float] = {}
    for peak in peaks:
        found[peak.role] = found.get(peak.role, 0.0) + peak.cpu_s
    return {role: round(seconds, 2) for role, seconds in sorted(found.items())}
