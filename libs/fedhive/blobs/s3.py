"""The S3 adapter of the blobs port (boto3), built from `Settings` (clients, retries,
checksums and credentials: `fedhive.blobs.s3_calls`; multipart uploads from buffers:
`fedhive.blobs.s3_multipart`).

Presigned URLs are signed for `Settings.s3_public_endpoint_url` when it is set (sites reach S3
at another address than the services do).

Reads (`fetch_range`, `read_into`, and `size` as a one-byte read) go through URLs this store
signs for its own endpoint, read by a `PresignedFetcher` (http.client straight into the
destination), which keeps each key's URL until S3 refuses it: a 1 MiB ranged read costs ~0.4 ms
of CPU that way against ~1.3-2 ms through botocore's `get_object`, a size ~0.6 ms against ~1 ms
for `head_object` (botocore's request pipeline and response parsing; measured here).

Temporary credentials (boto3's chain): a URL they sign dies with them, so its `expires_at_ms`
is capped at their expiry.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import structlog
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from fedhive.blobs import s3_calls
from fedhive.blobs.http import PresignedFetcher
from fedhive.blobs.port import BlobLocation, Bytes, MultipartGrant, PresignedUrl
from fedhive.blobs.s3_multipart import MAX_PARTS, MIN_PART, put_multipart, stream
from fedhive.blobs.transfer import MiB, Segment, body_views, plan_reads, run_reads
from fedhive.config import Settings
from fedhive.errors import (
    AlreadyExists,
    BlobAccessDenied,
    BlobNotFound,
    FedhiveError,
    InvalidArgument,
)
from fedhive.retry import Backoff

if TYPE_CHECKING:
    from botocore.credentials import Credentials
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import CompletedPartTypeDef

T = TypeVar("T")
log = structlog.get_logger()

_DELETE_BATCH = 1000  # S3's limit on keys per DeleteObjects
_READ_URL_TTL_S = 3600  # this store's own read URLs (renewed when S3 refuses one)
_READ_URLS_KEPT = 4096
_MAX_EXPIRY = 7 * 24 * 3600  # SigV4 presigned URLs live at most 7 days


def _condition(write_once: bool) -> dict[str, Any]:
    """S3's conditional write (AWS, MinIO, SeaweedFS): refused with 412 when the key exists."""
    return {"IfNoneMatch": "*"} if write_once else {}


class S3BlobStore:
    """`BlobStore` over one S3 bucket. Thread-safe; `close()` releases its connections."""

    def __init__(
        self,
        client: S3Client,
        bucket: str,
        *,
        region: str = "us-east-1",
        workers: int = 8,
        part_size: int = 8 * MiB,
        multipart_threshold: int = 16 * MiB,  # = the codec's `large_object`
        read_part_size: int = 8 * MiB,
        backoff: Backoff | None = None,
        presigner: S3Client | None = None,
        credentials: Credentials | None = None,
        ca_file: str | None = None,  # what an https:// endpoint's certificate is checked against
    ) -> None:
        if part_size < MIN_PART:
            raise InvalidArgument("S3 multipart parts must be at least 5 MiB", field="part_size")
        self._client = client
        self._presigner = presigner or client
        self._credentials = credentials  # what the clients sign with (for its expiry)
        self._bucket = bucket
        self._region = region
        self._workers = workers
        self._part_size = part_size
        self._multipart_threshold = max(multipart_threshold, part_size)
        self._read_part_size = read_part_size
        self._backoff = backoff or Backoff()
        # its URLs are wanted for seconds (a size, then the read): a few thousand are plenty
        self._reader = PresignedFetcher(backoff=self._backoff, resign=self._sign_reads,
                                        keep_urls=_READ_URLS_KEPT,
                                        ssl_context=ssl.create_default_context(cafile=ca_file))

    @classmethod
    def from_settings(cls, settings: Settings, **options: Any) -> S3BlobStore:
        """The store of `settings` (its clients: `s3_calls.connect`)."""
        clients = s3_calls.connect(settings, workers=int(options.get("workers", 8)))
        return cls(clients.client, settings.s3_bucket, region=settings.s3_region,
                   presigner=clients.presigner, credentials=clients.credentials,
                   ca_file=settings.s3_ca_file, **options)

    @property
    def bucket(self) -> str:
        return self._bucket

    def close(self) -> None:
        self._reader.close()
        self._client.close()
        if self._presigner is not self._client:
            self._presigner.close()

    # --- bucket and objects --------------------------------------------------------------------
    def ensure_bucket(self) -> None:
        try:
            self._call(
                "checking", self._bucket, lambda: self._client.head_bucket(Bucket=self._bucket)
            )
            return
        except BlobNotFound:
            pass
        except BlobAccessDenied:
            # a HEAD answer has no error document: a GET learns S3's reason (InvalidAccessKeyId,
            # ExpiredToken, AccessDenied), which is then the error
            self._call("checking", self._bucket, lambda: self._client.list_objects_v2(
                Bucket=self._bucket, MaxKeys=1))
            return
        try:
            if self._region == "us-east-1":
                self._client.create_bucket(Bucket=self._bucket)
            else:
                self._client.create_bucket(
                    Bucket=self._bucket,
                    CreateBucketConfiguration={"LocationConstraint": self._region},  # type: ignore[typeddict-item]
                )
            log.info("bucket created", bucket=self._bucket)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            if code == "BucketAlreadyExists":
                raise AlreadyExists(
                    f"bucket {self._bucket} belongs to another account", field=self._bucket
                ) from err
            if code != "BucketAlreadyOwnedByYou":  # a concurrent creator won the race: fine
                raise s3_calls.translate(err, "creating", self._bucket) from err

    def put(self, key: str, body: Bytes | Sequence[Bytes]) -> None:
        views = body_views(body)
        total = sum(len(v) for v in views)
        if total < self._multipart_threshold:
            self._call(
                "writing",
                key,
                lambda: self._client.put_object(
                    Bucket=self._bucket, Key=key, Body=stream(views)
                ),
            )
        else:
            put_multipart(self._client, self._call, self._bucket, key, views,
                          part_size=self._part_size, workers=self._workers)

    def put_file(self, key: str, file: BinaryIO) -> None:
        # boto3's transfer manager: parts read from the file as they go (workers x part size
        # in memory at most), multipart above the threshold, retried per part.
        config = TransferConfig(multipart_threshold=self._multipart_threshold,
                                multipart_chunksize=self._part_size,
                                max_concurrency=self._workers, use_threads=True)

        def once() -> None:
            file.seek(0)
            self._client.upload_fileobj(file, self._bucket, key, Config=config)

        self._call("writing", key, once)

    def get(self, key: str) -> bytes:
        def once() -> bytes:
            body = self._client.get_object(Bucket=self._bucket, Key=key)["Body"]
            try:
                return body.read()
            finally:
                body.close()

        return self._call("reading", key, once)

    def read_into(self, key: str, dest: memoryview, offset: int = 0) -> None:
        reads = plan_reads([Segment(BlobLocation(key), offset, dest)], self._read_part_size)
        run_reads(self, reads, self._workers)

    def fetch_range(self, where: BlobLocation, offset: int, dests: Sequence[memoryview]) -> None:
        self._reader.fetch_range(BlobLocation(where.key), offset, dests)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except BlobNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        try:
            return self._reader.length(BlobLocation(key))  # its URL then serves the read too
        except InvalidArgument:  # an empty object (no byte 0 to read): S3 says it itself
            head = self._call(
                "checking", key, lambda: self._client.head_object(Bucket=self._bucket, Key=key)
            )
            return int(head["ContentLength"])

    def delete(self, *keys: str) -> None:
        if len(keys) == 1:
            self._call("deleting", keys[0],
                       lambda: self._client.delete_object(Bucket=self._bucket, Key=keys[0]))
            return
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start:start + _DELETE_BATCH]]
            answer = self._call(
                "deleting", batch[0]["Key"],
                lambda batch=batch: self._client.delete_objects(  # type: ignore[misc]
                    Bucket=self._bucket, Delete={"Objects": batch, "Quiet": True}))
            errors = answer.get("Errors", [])
            if errors:
                first = errors[0]
                raise FedhiveError(
                    f"deleting blob {first.get('Key')}: {first.get('Code')} {first.get('Message')}",
                    field=first.get("Key"),
                )

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise InvalidArgument("refusing to delete a whole bucket: empty prefix", field="prefix")
        deleted = 0
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=prefix
        )
        for page in pages:
            keys = [item["Key"] for item in page.get("Contents", [])]
            self.delete(*keys)
            deleted += len(keys)
        return deleted

    def presign_get(self, key: str, expires_in: int) -> PresignedUrl:
        return self._presign("get_object", key, expires_in)

    def presign_put(
        self, key: str, expires_in: int, *, write_once: bool = False
    ) -> PresignedUrl:
        # the condition is a signed header (X-Amz-SignedHeaders: host;if-none-match): a PUT
        # without it does not match the signature (403), one with it is refused once the key
        # exists (412)
        return self._presign("put_object", key, expires_in, **_condition(write_once))

    def url_prefix(self) -> str:
        """What the address of every presigned URL of this store starts with: scheme, host,
        port and, path-style, the bucket (a site's `storage_url`: it deploys only bundles from
        under it). Signing is local: no request is made."""
        probe = "fedhive-url-prefix-probe"
        url = self._presign("get_object", probe, 60).url.split("?", 1)[0]
        return url.removesuffix(f"/{probe}")

    # --- multipart uploads by someone without credentials -------------------------------------
    def presign_multipart(
        self, key: str, size: int, part_size: int, expires_in: int
    ) -> MultipartGrant:
        if size <= 0:
            raise InvalidArgument(
                f"multipart upload of blob {key} needs a positive size, not {size}", field="size"
            )
        self._check_expiry(expires_in)
        part_size = max(part_size, MIN_PART, -(-size // MAX_PARTS))
        upload_id: str = self._call(
            "writing",
            key,
            lambda: self._client.create_multipart_upload(Bucket=self._bucket, Key=key),
        )["UploadId"]
        urls = [
            self._presign(
                "upload_part", key, expires_in, UploadId=upload_id, PartNumber=number
            )
            for number in range(1, -(-size // part_size) + 1)
        ]
        return MultipartGrant(upload_id, part_size, urls)

    def complete_multipart(
        self, key: str, upload_id: str, etags: Sequence[str], *, write_once: bool = False
    ) -> None:
        if not etags or not all(etags):
            raise InvalidArgument(
                f"completing blob {key}: {len(etags)} part ETags, some empty or none",
                field="etags",
            )
        parts: list[CompletedPartTypeDef] = [
            {"ETag": etag, "PartNumber": number} for number, etag in enumerate(etags, start=1)
        ]
        self._call(
            "completing",
            key,
            lambda: self._client.complete_multipart_upload(
                Bucket=self._bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": parts}, **_condition(write_once),
            ),
        )

    def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            self._call(
                "aborting",
                key,
                lambda: self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=key, UploadId=upload_id
                ),
            )
        except (InvalidArgument, BlobNotFound) as err:
            log.debug("abort of an unknown multipart upload", key=key, error=str(err))

    # --- internals -----------------------------------------------------------------------------
    @staticmethod
    def _check_expiry(expires_in: int) -> None:
        if not 1 <= expires_in <= _MAX_EXPIRY:
            raise InvalidArgument(
                f"presigned URL expiry {expires_in}s is outside 1..{_MAX_EXPIRY}s",
                field="expires_in",
            )

    def _sign_reads(self, keys: list[str]) -> dict[str, PresignedUrl]:
        """GET URLs for this store's own reads: signed for its endpoint, not the public one."""
        return {key: self._presign("get_object", key, _READ_URL_TTL_S, signer=self._client)
                for key in keys}

    def _presign(self, method: str, key: str, expires_in: int, *,
                 signer: S3Client | None = None, **params: Any) -> PresignedUrl:
        self._check_expiry(expires_in)
        expires_at_ms = int(time.time() * 1000) + expires_in * 1000
        client = signer or self._presigner
        url = self._call("signing", key, lambda: client.generate_presigned_url(
            method, Params={"Bucket": self._bucket, "Key": key, **params}, ExpiresIn=expires_in
        ))
        # read after signing: signing refreshes credentials about to expire
        dies_ms = self._credentials_expiry_ms()
        return PresignedUrl(url, expires_at_ms if dies_ms is None else min(expires_at_ms, dies_ms))

    def _credentials_expiry_ms(self) -> int | None:
        """When temporary credentials expire (unix ms); None for static keys. botocore keeps
        the expiry of its `RefreshableCredentials` in `_expiry_time` (no public accessor)."""
        expiry = getattr(self._credentials, "_expiry_time", None)
        return int(expiry.timestamp() * 1000) if isinstance(expiry, datetime) else None

    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        return s3_calls.call(self._backoff, action, key, fn)
