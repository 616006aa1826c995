"""Round trips of the job dataclasses through protobuf (and its bytes) and through JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedhive.errors import MalformedMessage
from fedhive.jobs import serde
from fedhive.jobs.record import JobMeta, JobRecord, JobStatusEvent, StatusChange, Submitter
from fedhive.jobs.status import JobStatus
from fedhive.proto.v1 import job_pb2

# What a protobuf Struct can carry without loss: JSON values with integers inside 2**53.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
names = st.text(max_size=12)
int32 = st.integers(0, 2**31 - 1)
times = st.none() | st.integers(1, 2**62)
statuses = st.sampled_from(JobStatus)

metas = st.builds(
    JobMeta,
    name=names,
    resource_spec=st.dictionaries(names, json_objects, max_size=3),
    deploy_map=st.dictionaries(names, st.lists(names, max_size=3), max_size=3),
    min_clients=st.none() | int32,
    mandatory_clients=st.lists(names, max_size=3),
    extra=json_objects,
)
changes = st.builds(
    StatusChange,
    from_status=st.none() | statuses,
    to_status=statuses,
    reason=names,
    at_ms=st.integers(0, 2**62),
)
records = st.builds(
    JobRecord,
    job_id=names,
    meta=metas,
    status=statuses,
    submitter=st.builds(Submitter, name=names, org=names, role=names),
    submit_time_ms=st.integers(0, 2**62),
    start_time_ms=times,
    end_time_ms=times,
    schedule_count=int32,
    last_schedule_time_ms=times,
    next_schedule_time_ms=times,
    sites=st.lists(names, max_size=4),
    failed_sites=st.lists(names, max_size=4),
    archive_key=names,
    result_key=names,
    history=st.lists(changes, max_size=4),
    pending_reason=json_objects,
    resumed_from=names,
)


@given(records)
def test_record_round_trips_through_protobuf_bytes(record: JobRecord) -> None:
    wire = serde.record_to_proto(record).SerializeToString()
    assert serde.record_from_proto(job_pb2.JobRecord.FromString(wire)) == record


@given(metas)
def test_meta_round_trips_through_protobuf_and_json(meta: JobMeta) -> None:
    assert serde.meta_from_proto(serde.meta_to_proto(meta)) == meta
    assert serde.meta_from_dict(json.loads(json.dumps(serde.meta_to_dict(meta)))) == meta


@given(st.builds(JobStatusEvent, job_id=names, change=changes))
def test_status_event_round_trips(event: JobStatusEvent) -> None:
    wire = serde.event_to_proto(event).SerializeToString()
    assert serde.event_from_proto(job_pb2.JobStatusEvent.FromString(wire)) == event


def test_every_status_maps_to_its_own_proto_value() -> None:
    numbers = {serde.status_to_proto(status) for status in JobStatus}
    assert len(numbers) == len(JobStatus) and job_pb2.JOB_STATUS_UNSPECIFIED not in numbers
    for status in JobStatus:
        assert serde.status_from_proto(serde.status_to_proto(status)) == status
    assert serde.status_to_proto(JobStatus.FINISHED_CANT_SCHEDULE) == (
        job_pb2.JOB_STATUS_FINISHED_CANT_SCHEDULE
    )
    assert serde.status_from_proto(job_pb2.JOB_STATUS_UNSPECIFIED) is None


def test_whole_numbers_come_back_as_int() -> None:
    spec: dict[str, Any] = {"num_gpus": 2, "mem_gb": 2.5, "nested": [1, {"k": 3}]}
    back = serde.struct_to_dict(serde.dict_to_struct(spec))
    assert back == spec and isinstance(back["num_gpus"], int)
    assert isinstance(back["nested"][1]["k"], int)


def test_bad_status_numbers_are_malformed() -> None:
    with pytest.raises(MalformedMessage, match="99"):
        serde.status_from_proto(99)
    message = job_pb2.JobRecord(job_id="job-1")  # status left UNSPECIFIED
    with pytest.raises(MalformedMessage, match="status"):
        serde.record_from_proto(message)
