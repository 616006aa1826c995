"""Job records as replies carry them: each one encodable, every reply under gRPC's limit.

Since meta.json is bounded (`fedhive.jobs.limits`) a record is a few KiB. A record stored
before that (or by a writer that skipped the checks) may be huge, nested past what protobuf
decoders accept, or hold a number its wire type cannot: it is sent trimmed, its meta replaced
by its name and a note, so one such record never breaks `fedhive jobs`, `job` or `delete` for
every admin. A list reply ends before it would pass gRPC's default 4 MiB message limit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import structlog
from google.protobuf.message import EncodeError

from fedhive.jobs.archive import MiB
from fedhive.jobs.jsontext import depth
from fedhive.jobs.limits import MAX_META_DEPTH, MAX_REASON, KiB
from fedhive.jobs.record import JobMeta, JobRecord
from fedhive.jobs.serde import meta_to_dict, record_to_proto
from fedhive.proto.v1 import admin_pb2, job_pb2
from fedhive.text import clip

log = structlog.get_logger()

MAX_RECORD_BYTES = 1 * MiB  # a larger record is sent trimmed
MAX_LIST_BYTES = 4 * MiB - 64 * KiB  # gRPC's default receive limit, less room for framing
TRIMMED = "fedhive_trimmed"  # the key of the note in a trimmed record's meta.extra
_ENCODE_ERRORS = (ValueError, TypeError, RecursionError, EncodeError)


def record_reply(record: JobRecord) -> job_pb2.JobRecord:
    """The record's wire form, trimmed when it cannot be sent whole."""
    try:
        nesting = depth(meta_to_dict(record.meta))
        if nesting > MAX_META_DEPTH + 1:  # meta_to_dict nests `extra` one level deeper
            why = f"it is nested {nesting} levels deep"
        else:
            message = record_to_proto(record)
            if message.ByteSize() <= MAX_RECORD_BYTES:
                return message
            why = f"the record is {message.ByteSize()} bytes"
    except _ENCODE_ERRORS as err:
        why = f"it cannot be encoded ({type(err).__name__})"
    log.warning("job_store.record_trimmed", service="job-store", job_id=record.job_id, why=why)
    return record_to_proto(_trimmed(record, f"meta.json left out: {why}"))


def list_reply(records: Iterable[JobRecord]) -> admin_pb2.ListJobsReply:
    """The records in order, as many as fit in MAX_LIST_BYTES."""
    reply = admin_pb2.ListJobsReply()
    size = 0
    for record in records:
        message = record_reply(record)
        size += message.ByteSize() + 8  # the field's tag and length prefix
        if size > MAX_LIST_BYTES:
            log.info("job_store.list_cut", service="job-store", jobs=len(reply.jobs))
            break
        reply.jobs.append(message)
    return reply


def _trimmed(record: JobRecord, note: str) -> JobRecord:
    return replace(
        record,
        meta=JobMeta(name=clip(record.meta.name, 128, quote=False), extra={TRIMMED: note}),
        history=[replace(c, reason=clip(c.reason, MAX_REASON, quote=False))
                 for c in record.history],
        pending_reason={},
        site_states={},
    )
