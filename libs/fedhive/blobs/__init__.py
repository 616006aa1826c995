"""Blobs: the store port and its adapters (S3; local disk for runs without S3), presigned-URL
access and the tensor codec (DESIGN §5)."""

from typing import TYPE_CHECKING, Any

from fedhive.blobs.cache import TensorCache
from fedhive.blobs.codec import PackStats, TensorCodec, inline_budget_for, inline_refs
from fedhive.blobs.dtypes import DTYPES, bfloat16_bits_to_float32
from fedhive.blobs.http import HttpPool, PresignedFetcher, Resign
from fedhive.blobs.keys import content_key
from fedhive.blobs.local import LocalBlobStore
from fedhive.blobs.port import (
    WRITE_ONCE_HEADERS,
    BlobLocation,
    BlobStore,
    MultipartGrant,
    PresignedUrl,
    RangeFetcher,
    UrlPreparer,
)
from fedhive.blobs.ref import TensorKind, TensorRef
from fedhive.blobs.serde import (
    Attachment,
    add_ref,
    bundle_from_proto,
    bundle_to_proto,
    ref_from_proto,
    ref_to_proto,
)
from fedhive.blobs.unpack import inline_values, unpack
from fedhive.blobs.upload import PresignedUploader

if TYPE_CHECKING:
    from fedhive.blobs.s3 import S3BlobStore


def __getattr__(name: str) -> Any:
    """`S3BlobStore` is imported when first named: boto3 costs ~0.1 s of every process start,
    and trainers and site agents reach S3 only through presigned URLs."""
    if name == "S3BlobStore":
        from fedhive.blobs.s3 import S3BlobStore

        return S3BlobStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "DTYPES",
    "WRITE_ONCE_HEADERS",
    "Attachment",
    "BlobLocation",
    "BlobStore",
    "HttpPool",
    "LocalBlobStore",
    "MultipartGrant",
    "PackStats",
    "PresignedFetcher",
    "PresignedUploader",
    "PresignedUrl",
    "RangeFetcher",
    "Resign",
    "S3BlobStore",
    "TensorCache",
    "TensorCodec",
    "TensorKind",
    "TensorRef",
    "UrlPreparer",
    "add_ref",
    "bfloat16_bits_to_float32",
    "bundle_from_proto",
    "bundle_to_proto",
    "content_key",
    "inline_budget_for",
    "inline_refs",
    "inline_values",
    "ref_from_proto",
    "ref_to_proto",
    "unpack",
]
