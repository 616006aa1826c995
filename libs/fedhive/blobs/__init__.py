"""S3 blobs: the store port and adapter, presigned-URL access and the tensor codec (DESIGN §5)."""

from fedhive.blobs.codec import TensorCodec, unpack
from fedhive.blobs.dtypes import DTYPES, bfloat16_bits_to_float32
from fedhive.blobs.http import PresignedFetcher
from fedhive.blobs.port import BlobLocation, BlobStore, PresignedUrl, RangeFetcher
from fedhive.blobs.ref import TensorKind, TensorRef
from fedhive.blobs.s3 import S3BlobStore
from fedhive.blobs.serde import bundle_from_proto, bundle_to_proto, ref_from_proto, ref_to_proto

__all__ = [
    "DTYPES",
    "BlobLocation",
    "BlobStore",
    "PresignedFetcher",
    "PresignedUrl",
    "RangeFetcher",
    "S3BlobStore",
    "TensorCodec",
    "TensorKind",
    "TensorRef",
    "bfloat16_bits_to_float32",
    "bundle_from_proto",
    "bundle_to_proto",
    "ref_from_proto",
    "ref_to_proto",
    "unpack",
]
