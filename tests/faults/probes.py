"""Probes against a running fault system (issue #16 point 1), shared by tests/faults and
bench/faults.py:

* `site_probes(faults)`: tests/fixtures/site_probes.py's raw-credential attempts, once with each
  site's own broker credentials (read from its site folder, as its job code could) against
  the other site and the services: the broker must refuse every one.
* `rogue_probes(faults, rogue_url, job_id)`: what a broker user allowed everything, who is not
  the services' user, sends to the running services themselves: an RPC or a command to the
  job-store, the job-runner and a site agent, a status event to the scheduler, a site
  heartbeat to the runner's intake. Each must be refused by the consumer (`bus.sender_refused`
  in that service's log; an RPC is answered PERMISSION_DENIED); `job_id` (a running job the
  forged commands name) must be untouched.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from google.protobuf.message import Message

from fedhive.bus import RabbitBus
from fedhive.errors import FedhiveError, PermissionDenied
from fedhive.names import Names
from fedhive.proto.v1 import admin_pb2, job_pb2, runner_pb2, site_pb2
from tests.faults.harness import Faults
from tests.fixtures.site_probes import ProbeResult, run_probes

REFUSAL_WAIT_S = 15.0
RPC_TIMEOUT_S = 3.0


def site_probes(faults: Faults) -> list[ProbeResult]:
    results = []
    for agent, other in zip(faults.agents, reversed(faults.agents), strict=True):
        config = json.loads((agent.site_dir / "local" / "site.json").read_text())
        results += [dataclasses.replace(r, name=f"{agent.site}: {r.name}") for r in
                    run_probes(config["broker_url"], faults.settings.namespace, agent.site,
                               other.site)]
    return results


def _refusals(path: Path, sender: str, type_name: str) -> int:
    """How many messages of `type_name` from `sender` the service whose log that is refused."""
    if not path.exists():
        return 0
    wanted = ('"bus.sender_refused"', f'"sender": "{sender}"', f'"type": "{type_name}"')
    return sum(all(w in line for w in wanted)
               for line in path.read_text(errors="replace").splitlines())


def _refused_in(log: Callable[[], Path], message_id: str) -> bool:
    """Whether the service whose log that is refused the message `message_id`."""
    wanted = ('"bus.sender_refused"', f'"message_id": "{message_id}"')
    deadline = time.monotonic() + REFUSAL_WAIT_S
    while time.monotonic() < deadline:
        path = log()
        if path.exists() and any(all(w in line for w in wanted)
                                 for line in path.read_text(errors="replace").splitlines()):
            return True
        time.sleep(0.2)
    return False


def _rpc(name: str, rogue: RabbitBus, log: Path, queue: str, request: Message,
         reply_type: type[Message]) -> ProbeResult:
    """An RPC: refused when the service logged the refusal (and answered PERMISSION_DENIED,
    or could not answer at all: a site may not publish replies to direct reply-to)."""
    type_name = request.DESCRIPTOR.full_name
    before = _refusals(log, rogue.user, type_name)
    try:
        reply = rogue.call(queue, request, reply_type, timeout=RPC_TIMEOUT_S)
    except PermissionDenied as err:
        answer = f"PERMISSION_DENIED: {err}"
    except FedhiveError as err:
        answer = f"{type(err).__name__}"
    else:
        return ProbeResult(name, True, f"answered {type(reply).__name__}")
    deadline = time.monotonic() + REFUSAL_WAIT_S
    while _refusals(log, rogue.user, type_name) <= before:
        if time.monotonic() > deadline:
            return ProbeResult(name, True, f"{answer}, but no refusal logged")
        time.sleep(0.2)
    return ProbeResult(name, False, answer)


def rogue_probes(faults: Faults, rogue_url: str, job_id: str) -> list[ProbeResult]:
    system = faults.system
    names = Names(faults.settings.namespace)
    agent = faults.agents[0]
    store, runner = system.store.queue, names.service_queue("job-runner")
    # replies by direct reply-to: a refusing service's PERMISSION_DENIED reaches it
    rogue = RabbitBus(dataclasses.replace(faults.settings, amqp_url=rogue_url), name="rogue",
                      site=True)
    results = []
    try:
        results += [
            _rpc("rogue: list jobs at the job-store", rogue, system.store.log_path, store,
                 admin_pb2.ListJobsRequest(), admin_pb2.ListJobsReply),
            _rpc("rogue: abort a job at the job-runner", rogue, system.runner.log_path, runner,
                 admin_pb2.AbortJobRequest(job_id=job_id), job_pb2.JobRecord),
            _rpc("rogue: list a site's jobs", rogue, agent.log_path, agent.queue,
                 site_pb2.ListSiteJobsRequest(), site_pb2.ListSiteJobsReply),
        ]
        scheduler = system.live_schedulers()[0]
        sent: list[tuple[str, str, Callable[[], Path]]] = [
            ("rogue: delete a job at the job-store (command)",
             rogue.send(store, admin_pb2.DeleteJobRequest(job_id=job_id)),
             lambda: system.store.log_path),
            ("rogue: dispatch a job at the job-runner (command)",
             rogue.send(runner, runner_pb2.DispatchJob(job_id=job_id)),
             lambda: system.runner.log_path),
            ("rogue: abort at a site (command)",
             rogue.send(agent.queue, site_pb2.AbortRequest(job_id=job_id, reason="rogue")),
             lambda: agent.log_path),
            ("rogue: wake the scheduler with a status event",
             rogue.publish_event(Names.job_status_event("SUBMITTED"),
                                 job_pb2.JobStatusEvent(job_id=job_id)),
             lambda: scheduler.log_path),
            ("rogue: a site's heartbeat into the runner's intake",
             rogue.publish_event(Names.site_event(agent.site, "heartbeat"),
                                 site_pb2.SiteHeartbeat(site=agent.site)),
             lambda: system.runner.log_path),
        ]
    finally:
        rogue.close()
    for name, message_id, log in sent:
        refused = _refused_in(log, message_id)
        results.append(ProbeResult(name, not refused, "bus.sender_refused" if refused
                                   else f"no refusal of message {message_id} logged"))
    return results
