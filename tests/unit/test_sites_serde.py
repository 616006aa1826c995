"""Heartbeats round-trip through their wire form and their stored JSON form."""

import json

from hypothesis import given
from hypothesis import strategies as st

from fedhive.proto.v1 import site_pb2
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.sites.serde import (
    job_heartbeat_from_proto,
    job_heartbeat_to_proto,
    site_heartbeat_from_dict,
    site_heartbeat_from_proto,
    site_heartbeat_to_dict,
    site_heartbeat_to_proto,
)

names = st.text(max_size=12)
resources = st.dictionaries(
    names,
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
        max_leaves=8,
    ),
    max_size=4,
)
site_beats = st.builds(
    SiteHeartbeat,
    site=names,
    org=names,
    running_job_ids=st.lists(names, max_size=4),
    resources=resources,
    agent_version=st.text(max_size=8),
    sent_at_ms=st.integers(0, 2**62),
)
job_beats = st.builds(
    JobHeartbeat,
    job_id=names,
    site=names,
    sent_at_ms=st.integers(0, 2**62),
    current_task=names,
    progress=st.floats(0, 1),
)


@given(site_beats)
def test_site_heartbeat_round_trips(beat: SiteHeartbeat) -> None:
    wire = site_heartbeat_to_proto(beat).SerializeToString()
    assert site_heartbeat_from_proto(site_pb2.SiteHeartbeat.FromString(wire)) == beat
    stored = json.loads(json.dumps(site_heartbeat_to_dict(beat)))
    assert site_heartbeat_from_dict(stored) == beat


def test_resource_counts_stay_integers() -> None:
    beat = SiteHeartbeat("site-1", resources={"num_gpus": 2, "free": {"num_gpus": 1}})
    back = site_heartbeat_from_proto(site_heartbeat_to_proto(beat))
    assert type(back.resources["num_gpus"]) is int
    assert type(back.resources["free"]["num_gpus"]) is int


@given(job_beats)
def test_job_heartbeat_round_trips(beat: JobHeartbeat) -> None:
    wire = job_heartbeat_to_proto(beat).SerializeToString()
    assert job_heartbeat_from_proto(site_pb2.JobHeartbeat.FromString(wire)) == beat
