"""Multipart uploads of the S3 store from the caller's buffers: parts uploaded in parallel,
each retried on its own, the upload aborted when any part fails for good."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Any, cast

import structlog
from botocore.exceptions import ClientError

from fedhive.blobs.s3_calls import TRANSIENT
from fedhive.blobs.transfer import GatherReader, MiB, slice_views

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

log = structlog.get_logger()

MAX_PARTS = 10_000  # S3's limit on parts per multipart upload
MIN_PART = 5 * MiB  # S3's smallest part (all but the last)

Call = Callable[[str, str, Callable[[], Any]], Any]  # (action, key, request) -> its answer


def stream(views: list[memoryview]) -> IO[bytes]:
    """An upload body streamed from the caller's buffers (botocore reads it in small blocks)."""
    return cast(IO[bytes], GatherReader(views))


def put_multipart(client: S3Client, call: Call, bucket: str, key: str,
                  views: list[memoryview], *, part_size: int, workers: int) -> None:
    """Upload `views` (their bytes in order) as `key`, `part_size` bytes a part (raised to
    stay within S3's part count), `workers` parts at a time."""
    total = sum(len(view) for view in views)
    part_size = max(part_size, -(-total // MAX_PARTS))
    bounds = [
        (number, start, min(start + part_size, total))
        for number, start in enumerate(range(0, total, part_size), start=1)
    ]
    upload_id = call("writing", key, lambda: client.create_multipart_upload(
        Bucket=bucket, Key=key))["UploadId"]

    def upload(number: int, start: int, stop: int) -> CompletedPartTypeDef:
        pieces = slice_views(views, start, stop)
        answer = call("writing", key, lambda: client.upload_part(
            Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=stream(pieces)))
        return {"ETag": answer["ETag"], "PartNumber": number}

    pool = ThreadPoolExecutor(max_workers=min(workers, len(bounds)))
    try:
        futures = [pool.submit(upload, *bound) for bound in bounds]
        parts = [future.result() for future in futures]
        call("writing", key, lambda: client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}))
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except (ClientError, *TRANSIENT) as err:
            log.warning("abort multipart upload failed", key=key, error=repr(err))
        raise
    finally:
        pool.shutdown(wait=True)
