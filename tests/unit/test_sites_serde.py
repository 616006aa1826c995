"""Heartbeats survive protobuf round trips unchanged."""

from hypothesis import given
from hypothesis import strategies as st

from fedhive.proto.v1 import site_pb2
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.sites.serde import (
    job_heartbeat_from_proto,
    job_heartbeat_to_proto,
    site_heartbeat_from_proto,
    site_heartbeat_to_proto,
)

names = st.text(min_size=1, max_size=20)
# Struct stores numbers as doubles: resource reports use numbers that survive that exactly.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53).map(float) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
    max_leaves=10,
)


@given(
    site=names,
    org=st.text(max_size=10),
    sent=st.integers(0, 2**62),
    jobs=st.lists(names, max_size=4),
    resources=st.dictionaries(names, json_values, max_size=4),
    version=st.text(max_size=10),
)
def test_site_heartbeat_round_trip(
    site: str, org: str, sent: int, jobs: list[str], resources: dict[str, object], version: str
) -> None:
    beat = SiteHeartbeat(site, org, sent, jobs, resources, version)
    wire = site_heartbeat_to_proto(beat).SerializeToString()
    assert site_heartbeat_from_proto(site_pb2.SiteHeartbeat.FromString(wire)) == beat


@given(
    job=names,
    site=names,
    sent=st.integers(0, 2**62),
    task=st.text(max_size=10),
    progress=st.floats(0, 1),
)
def test_job_heartbeat_round_trip(
    job: str, site: str, sent: int, task: str, progress: float
) -> None:
    beat = JobHeartbeat(job, site, sent, task, progress)
    wire = job_heartbeat_to_proto(beat).SerializeToString()
    assert job_heartbeat_from_proto(site_pb2.JobHeartbeat.FromString(wire)) == beat
