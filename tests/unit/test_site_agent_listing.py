"""A site agent's record of a started job, against the runner's rule for its heartbeats: every
heartbeat stamped after the start's stamp lists the job (`not_listed`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from fedhive.state.runs import SiteState
from fedhive_services.job_runner.liveness import LISTING_SLACK_MS, not_listed
from fedhive_services.site_agent.heartbeat import site_heartbeat
from fedhive_services.site_agent.records import JobRecord, JobState
from tests.fixtures.site_agent import CLIENT_APP, app_bundle
from tests.unit.test_site_agent import make_agent, url


class _Idle:
    """A client job that runs until it is stopped (a thread of no process)."""

    pid, pid_started = 0, None

    def __init__(self) -> None:
        self._stopped = threading.Event()

    def wait(self) -> int:
        self._stopped.wait()
        return 0

    def stop(self, grace: float) -> bool:
        self._stopped.set()
        return False


class _IdleLauncher:
    def launch(self, module: str, args: Sequence[str], *, cwd: Path, env: Mapping[str, str],
               log_file: Path) -> _Idle:
        return _Idle()


def test_a_heartbeat_stamped_after_the_start_lists_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner takes the start reply's stamp as the time after which the site's heartbeats
    must list the job (`not_listed`): one taken while the record is being written must not
    break that, however long the write takes."""
    agent = make_agent(tmp_path, {"job-1": app_bundle(CLIENT_APP)})
    agent._launcher = _IdleLauncher()
    agent.allocate("job-1", agent.check_resources("job-1", {"gpu": 1}).token)
    agent.deploy("job-1", "app", url("job-1"), 0)
    write, during = agent._ws.save_job, []

    def slow_write(record: JobRecord) -> None:
        threading.Event().wait(0.01)  # the write takes a while: the clock moves on
        during.append(site_heartbeat(agent))
        write(record)

    monkeypatch.setattr(agent._ws, "save_job", slow_write)
    started = agent.start("job-1")
    after = site_heartbeat(agent)
    assert started.state is JobState.RUNNING and during
    for beat in [*during, after]:
        # held to the strict contract: every beat stamped after the start's stamp lists it
        since = started.updated_at_ms + 1 - LISTING_SLACK_MS
        assert not not_listed("job-1", SiteState(started=True, started_at_ms=since), beat), beat
    agent.abort("job-1", "done")
