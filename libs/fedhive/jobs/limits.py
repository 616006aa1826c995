"""The bounds on what a job and an admin request may hold, checked before anything is stored.

Every number fits the wire type it travels in (protobuf `int32`, or a `Struct`'s double, which
holds integers exactly only up to 2**53) and a sane maximum; every text a request carries has a
length bound. docs/jobs.md and docs/cli.md list them for users; a value past a bound is refused
with one line naming the field (`fedhive.text.clip` shows the value).
"""

from __future__ import annotations

import re
import uuid

from fedhive.errors import InvalidArgument
from fedhive.jobs.archive import MiB
from fedhive.text import clip

KiB = 1024

# meta.json ------------------------------------------------------------------------------------
# Its content as compact JSON. A FLARE meta is well under 1 KiB; 64 KiB leaves room for a
# resource_spec of hundreds of sites while a record stays far below gRPC's 4 MiB message limit
# (a Struct spends at most ~6 bytes per byte of compact JSON).
MAX_META_BYTES = 64 * KiB
# The file itself, refused before it is parsed: generous enough for any indentation of a meta
# within MAX_META_BYTES (fedhive stores it indented, and re-reads what it stored).
MAX_META_FILE_BYTES = 2 * MiB
# Objects and lists inside objects and lists. The meta travels as protobuf Structs, which cost
# about three message levels per JSON level, and protobuf decoders stop at 100 levels.
MAX_META_DEPTH = 16
MAX_META_INTEGER = 2**53  # larger integers do not survive a Struct (a double) exactly
MAX_MIN_CLIENTS = 10_000  # int32 on the wire
MAX_RESOURCE_AMOUNT = 10**9  # a number in resource_spec (GPUs, GiB, ...)
MAX_RUNTIME_S = 366 * 24 * 3600  # max_runtime, seconds

# app configs (parsed by Python only, never put in a protobuf Struct) ------------------------
MAX_CONFIG_DEPTH = 32

# meta and app configs written in HOCON (.conf) or YAML (.yml, .yaml) ---------------------------
# Their parsers are pure Python and slow (pyhocon reads about 15 KiB a second): a FLARE config is
# a few KiB, and these bounds keep a job's parsing to seconds. JSON has no such bound.
MAX_TEXT_FORM_BYTES = 64 * KiB  # one such file
MAX_TEXT_FORM_TOTAL = 256 * KiB  # all such files of one job

# admin requests -------------------------------------------------------------------------------
MAX_JOB_ID = 128  # fedhive's job ids are 36-character uuids
MAX_REASON = 1_000  # an abort reason, kept in the job's history
MAX_FILTER = 256  # a ListJobs filter (name, submitter, id prefix)
DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 10_000
SUBMISSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # FLARE's submit-token pattern


def submission_id_problem(value: str) -> str | None:
    """Why `value` cannot be a submission id ("" is no id, which is fine), or None."""
    if not value or SUBMISSION_ID.match(value):
        return None
    return (f"submission id {clip(value)} must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', "
            "':' or '-'")


def check_submission_id(value: str) -> str:
    problem = submission_id_problem(value)
    if problem is not None:
        raise InvalidArgument(problem, field="submission_id")
    return value


def check_chosen_job_id(value: str) -> str:
    """A job id a submitter chose ("" for none): a uuid in its canonical form, as fedhive's own
    ids are (it names queues and object keys)."""
    if not value:
        return value
    try:
        canonical = str(uuid.UUID(value))
    except ValueError:
        canonical = ""
    if canonical != value:
        raise InvalidArgument(f"job_id {clip(value)} is not a uuid in canonical form "
                              "(8-4-4-4-12 lowercase hex digits)", field="job_id")
    return value


def check_text(value: str, field: str, limit: int) -> str:
    """`value` when it has at most `limit` characters; InvalidArgument naming `field` if not."""
    if len(value) > limit:
        raise InvalidArgument(
            f"{field} {clip(value)} is longer than the limit of {limit} characters", field=field
        )
    return value


def check_list_limit(limit: int) -> int:
    """A ListJobs page size: 0 (the default, DEFAULT_LIST_LIMIT) up to MAX_LIST_LIMIT."""
    if not 0 <= limit <= MAX_LIST_LIMIT:
        raise InvalidArgument(
            f"limit {clip(limit)} must be between 0 (the default, {DEFAULT_LIST_LIMIT}) and "
            f"{MAX_LIST_LIMIT}", field="limit",
        )
    return limit
