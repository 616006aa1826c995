"""How a site sends a result's arrays up without S3 credentials (DESIGN §5).

One module for both senders: the client job's in-process executors (`fedhive.fl.worker`, which
reaches its server job by RPC) and a trainer subprocess (`fedhive.client`, which reaches it
through its client job's pipe). What differs is only the `UploadChannel`.

Small arrays travel inline in the result (each up to `inline_threshold` bytes, at most
`inline_budget` bytes in all, so a model of many small arrays cannot swell one message past
the broker's limit). The others are uploaded: the sender asks the server job for upload grants
for its task (each array's BLAKE3 checksum and size), uploads each array the grant does not
answer `present` to the key the grant names, the site's own for that task
(`{job tensor prefix}sites/<site>/<task>/blake3/<hex>`, `fedhive.blobs.keys`; a presigned
PUT, with `If-None-Match: *` when the grant says `write_once`, or presigned multipart parts in
parallel for a large array, then `complete`), and sends refs to the granted keys. An
unchanged array (a frozen layer: the server's object of that content), or one the site uploaded
before, is already there: nothing is uploaded.

A result value that is still a ref passes through unchanged when it is inline or names a key
of its own checksum (task data handed back as it came; the server takes it when it handed it
to this site); any other ref is downloaded and sent like an array.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from fedhive.blobs import (
    WRITE_ONCE_HEADERS,
    Attachment,
    RangeFetcher,
    TensorKind,
    TensorRef,
    checksum,
    inline_budget_for,
    unpack,
)
from fedhive.blobs.dtypes import ByteArray, is_torch_tensor, numpy_to_bytes, torch_to_bytes
from fedhive.blobs.keys import CONTENT_KEY_TAIL
from fedhive.blobs.port import MultipartGrant, PresignedUrl
from fedhive.blobs.transfer import as_byte_view
from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import Dxo, dxo_to_proto
from fedhive.proto.v1 import task_pb2


class UploadChannel(Protocol):
    """How a sender reaches its server job for uploads."""

    def grant(self, checksums: list[str], sizes: list[int]) -> task_pb2.UploadGrant:
        """The server's `UploadGrant` for these arrays (same order)."""
        ...

    def complete(self, key: str, upload_id: str, etags: list[str]) -> None:
        """Ask the server to complete a multipart upload it granted."""
        ...


class Uploader(Protocol):
    """`fedhive.blobs.PresignedUploader`'s face: credential-free PUTs."""

    def put(self, url: str, key: str, body: Any, *,
            headers: Mapping[str, str] | None = None) -> None: ...

    def put_parts(self, grant: MultipartGrant, key: str, body: Any) -> list[str]: ...


@dataclass
class _Array:
    name: str
    flat: ByteArray
    dtype: str
    shape: tuple[int, ...]
    kind: TensorKind
    digest: str


def is_content_ref(ref: TensorRef) -> bool:
    """A ref to the whole object at a key named by its own checksum (the server's, a site's
    upload: `fedhive.blobs.keys`)."""
    match = CONTENT_KEY_TAIL.search(ref.key)
    return bool(match and ref.offset == 0 and ref.checksum == ":".join(match.groups()))


class ResultPacker:
    def __init__(self, fetcher: RangeFetcher, uploader: Uploader, *, inline_threshold: int,
                 inline_budget: int | None = None, upload_workers: int = 4) -> None:
        self._fetcher = fetcher
        self._uploader = uploader
        self._threshold = inline_threshold
        self._budget = inline_budget_for(inline_threshold, inline_budget)
        self._workers = upload_workers

    def pack(self, dxo: Dxo, channel: UploadChannel, into: task_pb2.Dxo,
             attachment: Attachment | None = None) -> None:
        """Fill `into` (the result message's DXO field) with the result, its large arrays
        uploaded through `channel`, its inline ones' bytes in `attachment` when given (views
        of the arrays: send before changing them). Raises InvalidArgument for a value that is
        no array, BlobAccessDenied/Unavailable when an upload fails."""
        passed = {name: value for name, value in dxo.data.items()
                  if isinstance(value, TensorRef) and (value.is_inline or is_content_ref(value))}
        other_refs = [value for name, value in dxo.data.items()
                      if isinstance(value, TensorRef) and name not in passed]
        fetched = unpack(other_refs, self._fetcher) if other_refs else {}
        arrays = [_flatten(name, fetched.get(name, value)) for name, value in dxo.data.items()
                  if name not in passed]
        refs: dict[str, TensorRef] = {
            name: replace(ref, url="", url_expires_at_ms=0) for name, ref in passed.items()}
        uploads: dict[str, _Array] = {}
        inline_used = sum(ref.length for ref in passed.values() if ref.is_inline)
        for item in arrays:
            size = item.flat.nbytes
            if size == 0 or (size <= self._threshold and inline_used + size <= self._budget):
                inline_used += size
                refs[item.name] = _ref(item, inline_data=as_byte_view(item.flat).toreadonly())
            else:
                uploads.setdefault(item.digest, item)
        keys = self._upload(uploads, channel) if uploads else {}
        for item in arrays:
            if item.name not in refs:
                refs[item.name] = _ref(item, key=keys[item.digest])
        data = {name: refs[name] for name in dxo.data}
        dxo_to_proto(Dxo(dxo.data_kind, data, dict(dxo.meta)), _no_arrays, into=into,
                     attachment=attachment)

    def _upload(self, uploads: dict[str, _Array], channel: UploadChannel) -> dict[str, str]:
        answer = channel.grant(list(uploads), [item.flat.nbytes for item in uploads.values()])
        if [target.checksum for target in answer.targets] != list(uploads):
            raise InvalidArgument("the server's upload grant does not match the request",
                                  field="targets")
        todo = [target for target in answer.targets if not target.present]
        if todo:
            jobs: list[Callable[[], None]] = [
                _upload_job(self._uploader, channel, target, uploads[target.checksum])
                for target in todo]
            with ThreadPoolExecutor(max_workers=min(self._workers, len(jobs))) as pool:
                for future in [pool.submit(job) for job in jobs]:
                    future.result()
        return {target.checksum: target.key for target in answer.targets}


def _upload_job(uploader: Uploader, channel: UploadChannel, target: task_pb2.UploadGrant.Target,
                item: _Array) -> Callable[[], None]:
    body = as_byte_view(item.flat)
    if not target.upload_id:
        if not target.url:
            raise InvalidArgument(f"tensor {item.name!r}: the upload grant has no URL",
                                  field=item.name)
        headers = WRITE_ONCE_HEADERS if target.write_once else None
        return lambda: uploader.put(target.url, target.key, body, headers=headers)
    grant = MultipartGrant(target.upload_id, target.part_size,
                           [PresignedUrl(url, target.url_expires_at_ms)
                            for url in target.part_urls])
    if target.part_size <= 0 or len(grant.urls) != -(-len(body) // target.part_size):
        raise InvalidArgument(f"tensor {item.name!r}: the multipart grant has "
                              f"{len(grant.urls)} parts of {target.part_size} bytes for "
                              f"{len(body)} bytes", field=item.name)

    def multipart() -> None:
        etags = uploader.put_parts(grant, target.key, body)
        channel.complete(target.key, target.upload_id, etags)

    return multipart


def _ref(item: _Array, *, key: str = "", inline_data: bytes | memoryview = b"") -> TensorRef:
    return TensorRef(name=item.name, dtype=item.dtype, shape=item.shape, kind=item.kind,
                     key=key, length=item.flat.nbytes, checksum=item.digest,
                     inline_data=inline_data)


def _flatten(name: str, value: Any) -> _Array:
    if is_torch_tensor(value):
        flat, dtype = torch_to_bytes(name, value)
        shape, kind = tuple(int(d) for d in value.shape), TensorKind.TORCH
    elif isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        flat, dtype = numpy_to_bytes(name, array)
        shape, kind = tuple(array.shape), TensorKind.NUMPY
    else:
        raise InvalidArgument(f"result tensor {name!r} is a {type(value).__name__}, not a "
                              "numpy array or torch tensor", field=name)
    return _Array(name, flat, dtype, shape, kind, checksum.digest(flat))


def _no_arrays(arrays: Any) -> list[TensorRef]:
    raise AssertionError("every value is a ref already")
