"""How a client job sends a result's arrays up without S3 credentials (DESIGN §5).

Small arrays travel inline in the `TaskResult` (each up to `inline_threshold` bytes, at most
`inline_budget` bytes in all, so a model of many small arrays cannot swell one message past
the broker's limit). The others are uploaded: the CJ asks its server job for upload grants
(`GrantUploadRequest` with each array's sha256), PUTs each array the server does not have yet
to its presigned URL, and sends refs to the content keys `{job tensor prefix}sha256/<hex>`.
A result value that is still a ref (an executor passing task data through) is downloaded and
sent like any array: the server accepts only refs it granted.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedhive.blobs import PresignedFetcher, TensorKind, TensorRef, checksum
from fedhive.blobs.dtypes import ByteArray, is_torch_tensor, numpy_to_bytes, torch_to_bytes
from fedhive.blobs.transfer import as_byte_view
from fedhive.errors import InvalidArgument
from fedhive.fl.dxo import Dxo, dxo_to_proto
from fedhive.proto.v1 import task_pb2

Grant = Callable[[list[str]], task_pb2.UploadGrant]  # checksums -> the server's grant


@dataclass
class _Array:
    name: str
    flat: ByteArray
    dtype: str
    shape: tuple[int, ...]
    kind: TensorKind
    digest: str


class ResultPacker:
    def __init__(self, fetcher: PresignedFetcher, *, inline_threshold: int,
                 inline_budget: int | None = None, upload_workers: int = 4) -> None:
        self._fetcher = fetcher
        self._threshold = inline_threshold
        self._budget = 8 * inline_threshold if inline_budget is None else inline_budget
        self._workers = upload_workers

    def pack(self, dxo: Dxo, grant: Grant) -> task_pb2.Dxo:
        """The result's DXO message, its large arrays uploaded through `grant`. Raises
        InvalidArgument for a value that is no array, BlobAccessDenied/Unavailable when an
        upload fails."""
        if dxo.is_lazy:
            dxo = dxo.materialized(self._fetcher)
        arrays = [_flatten(name, value) for name, value in dxo.data.items()]
        refs: dict[str, TensorRef] = {}
        uploads: dict[str, _Array] = {}
        inline_used = 0
        for item in arrays:
            size = item.flat.nbytes
            if size == 0 or (size <= self._threshold and inline_used + size <= self._budget):
                inline_used += size
                refs[item.name] = _ref(item, inline_data=item.flat.tobytes())
            else:
                uploads.setdefault(item.digest, item)
        keys = self._upload(uploads, grant) if uploads else {}
        for item in arrays:
            if item.name not in refs:
                refs[item.name] = _ref(item, key=keys[item.digest])
        data = {item.name: refs[item.name] for item in arrays}
        return dxo_to_proto(Dxo(dxo.data_kind, data, dict(dxo.meta)), _no_arrays)

    def _upload(self, uploads: dict[str, _Array], grant: Grant) -> dict[str, str]:
        answer = grant(list(uploads))
        if [target.checksum for target in answer.targets] != list(uploads):
            raise InvalidArgument("the server's upload grant does not match the request",
                                  field="targets")
        todo = [target for target in answer.targets if not target.present]
        if todo:
            with ThreadPoolExecutor(max_workers=min(self._workers, len(todo))) as pool:
                done = [pool.submit(self._fetcher.put, target.url, target.key,
                                    as_byte_view(uploads[target.checksum].flat))
                        for target in todo]
                for future in done:
                    future.result()
        return {target.checksum: target.key for target in answer.targets}


def _ref(item: _Array, *, key: str = "", inline_data: bytes = b"") -> TensorRef:
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
