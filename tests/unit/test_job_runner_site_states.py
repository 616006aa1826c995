"""Per-site sub-state of a job (`JobRecord.site_states`): written by the job-runner from its
run entry, kept by both state stores, carried by the wire format and shown by the CLI."""

from __future__ import annotations

import io

from rich.console import Console

from fedhive.cli.render import job_json, print_job
from fedhive.jobs.serde import record_from_proto, record_to_proto
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import job_pb2
from fedhive.state import StateStore
from fedhive.state.port import Fence, JobUpdate
from fedhive.state.runs import RunEntry, SiteState
from fedhive_services.job_runner.finish import site_states
from tests.fixtures.state import submit_in

ENTRY = RunEntry("j1", "runner", 7, "running", sites={
    "site-1": SiteState(token="t1", allocated=True, deployed=True, started=True,
                        reported=True, seen_online=True, last_heartbeat_ms=1_700_000_000_000),
    "site-2": SiteState(token="t2", allocated=True, excluded="fatal: start failed: no GPU"),
    "site-3": SiteState(allocated=True, deployed=True, started=True, gone="site went offline"),
})
STATES = site_states(ENTRY)


def test_the_runner_entry_becomes_the_record_form() -> None:
    assert STATES["site-1"] == {"allocated": True, "deployed": True, "started": True,
                                "excluded": "", "gone": "",
                                "last_heartbeat_ms": 1_700_000_000_000}
    assert STATES["site-2"]["excluded"] == "start failed: no GPU"  # no internal marker
    assert STATES["site-3"]["gone"] == "site went offline"
    assert list(STATES) == ["site-1", "site-2", "site-3"]


def test_both_stores_keep_site_states_under_the_owners_fence(state_store: StateStore) -> None:
    submit_in(state_store, "j1", JobStatus.RUNNING)
    token = state_store.acquire("job:j1", "runner", 10)
    assert token is not None
    state_store.update_job("j1", JobUpdate(site_states=STATES), fence=Fence("job:j1", token))
    record = state_store.get_job("j1")
    assert record.site_states == STATES
    assert state_store.update_job("j1", JobUpdate(result_key="r")).site_states == STATES


def test_site_states_travel_on_the_wire() -> None:
    message = job_pb2.JobRecord(job_id="j1", status=job_pb2.JOB_STATUS_RUNNING)
    record = record_from_proto(message)
    assert record.site_states == {}
    back = record_from_proto(job_pb2.JobRecord.FromString(
        record_to_proto(record.__class__(**{**record.__dict__, "site_states": STATES}))
        .SerializeToString()))
    assert back.site_states == STATES


def test_the_cli_shows_site_states(memory_state: StateStore) -> None:
    submit_in(memory_state, "j1", JobStatus.RUNNING)
    record = memory_state.update_job("j1", JobUpdate(site_states=STATES))
    shown = job_json(record, now_ms=1_700_000_100_000)["site_states"]
    assert shown["site-1"]["last_heartbeat"] == "2023-11-14T22:13:20.000Z"
    assert shown["site-2"] == {"allocated": True, "deployed": False, "started": False,
                               "excluded": "start failed: no GPU", "gone": "",
                               "last_heartbeat": None}
    out = io.StringIO()
    print_job(Console(file=out, width=200), record, now_ms=1_700_000_100_000)
    text = out.getvalue()
    assert "excluded: start failed: no GPU" in text and "gone: site went offline" in text
    assert "2023-11-14 22:13:20" in text
