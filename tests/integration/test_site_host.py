"""A light-site host (`fedhive-site-agent host`): many sites in one process, each still its own
broker user with its own control queue, heartbeats and client jobs (threads); what cannot be
hosted is refused at start in one line. The site-agent tests run against a host too
(tests/integration/test_site_agent.py); a real job on light sites: tests/e2e/test_light_sites.py.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

from fedhive.blobs import BlobStore
from fedhive.bus import RabbitBus
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from tests.fixtures.infra import wait_for
from tests.fixtures.site_agent import (
    HOLDING_CJ,
    Events,
    SiteAgents,
    allocate,
    deploy,
    run_cli,
    start,
)

SITES = ["site-1", "site-2", "site-3"]


def test_each_hosted_site_is_its_own_broker_user_with_its_own_jobs(
    site_agents: SiteAgents, blob_store: BlobStore, make_bus: Callable[..., RabbitBus]
) -> None:
    events = Events(make_bus)
    agents = [site_agents.write(site, client_job_module=HOLDING_CJ) for site in SITES]
    host = site_agents.host(agents)
    names = Names(agents[0].namespace)
    for site in SITES:  # every site beats as its own broker user
        beats = wait_for(lambda s=site: events.of(f"site.{s}.heartbeat"), what=f"{site} beat")
        beat, user = beats[-1]
        assert isinstance(beat, site_pb2.SiteHeartbeat)
        assert (beat.site, user) == (site, names.site_user(site))

    # a job at site-2 only: its client job (a thread) runs there, the others know nothing of it
    allocate(agents[1], "job-1", {"gpu": 1})
    deploy(agents[1], blob_store, "job-1")
    assert start(agents[1], "job-1").pid == 0
    report = wait_for(lambda: agents[1].report("job-1"), what="the client job's report")
    assert report["site"] == "site-2" and report["pid"] == host.pid
    assert report["broker_user"] == names.site_user("site-2")
    assert agents[0].job("job-1") is None and agents[2].job("job-1") is None
    running = wait_for(lambda: [b for b, _ in events.of("site.site-2.heartbeat")
                                if isinstance(b, site_pb2.SiteHeartbeat) and b.running_job_ids],
                       what="site-2 reporting the job")
    assert list(running[-1].running_job_ids) == ["job-1"]

    aborted = agents[1].call(site_pb2.AbortRequest(job_id="job-1", reason="admin"),
                             site_pb2.SiteJob)
    assert aborted.state == "ABORTED"
    [notice] = wait_for(lambda: events.ended("site-2", "job-1"), what="the ended notice")
    assert notice.exit_code == -signal.SIGTERM

    host.send_signal(signal.SIGTERM)  # a clean shutdown: every site says it goes offline
    assert host.wait(timeout=60) == 0
    for site in SITES:
        wait_for(lambda s=site: events.of(f"site.{s}.offline"), what=f"{site} offline")


def test_a_hub_site_or_an_empty_root_is_refused_in_one_line(
    site_agents: SiteAgents, tmp_path: Path
) -> None:
    agent = site_agents.write("site-1")
    (agent.site_dir / "local" / "hub.json").write_text(json.dumps({"gateway": "127.0.0.1:1"}))
    done = run_cli("host", "--site-dir", str(agent.site_dir))
    assert done.returncode == 2
    assert "a hub site cannot be a light site" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1

    (tmp_path / "empty").mkdir()
    done = run_cli("host", "--sites-root", str(tmp_path / "empty"))
    assert done.returncode == 2 and "no site folder" in done.stderr
