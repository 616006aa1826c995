"""`TensorRef`: one array, either inline or a byte range of an S3 object (DESIGN §5).

The dataclass mirrors proto `fedhive.v1.TensorRef` field for field; `fedhive.blobs.serde`
converts between the two. A ref validates itself on construction so that a malformed ref is
rejected where it enters the process, not halfway through a download.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from fedhive.blobs.dtypes import itemsize
from fedhive.errors import InvalidArgument


class TensorKind(enum.Enum):
    """What `unpack` materialises: a numpy array or a torch tensor."""

    NUMPY = "numpy"
    TORCH = "torch"


@dataclass(frozen=True, kw_only=True)
class TensorRef:
    name: str
    dtype: str  # numpy-style name: "float32", "bfloat16", "bool", ...
    shape: tuple[int, ...]  # () for a 0-d array
    kind: TensorKind
    key: str = ""  # S3 object key; empty when inline
    url: str = ""  # presigned GET of `key`; empty when inline
    url_expires_at_ms: int = 0  # unix epoch milliseconds
    offset: int = 0  # byte offset inside the object
    length: int  # byte length of the array
    checksum: str  # "<algorithm>:<hex digest>" of the array's bytes
    inline_data: bytes | memoryview = field(default=b"", repr=False)  # a view: of an attachment

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("tensor ref has an empty name", field="name")
        size = itemsize(self.dtype, self.name)  # raises for an unknown dtype
        if any(dim < 0 for dim in self.shape):
            raise InvalidArgument(
                f"tensor {self.name!r} has a negative dimension in shape {self.shape}",
                field="shape",
            )
        expected = math.prod(self.shape) * size
        if self.length != expected:
            raise InvalidArgument(
                f"tensor {self.name!r}: length {self.length} does not match "
                f"{self.dtype}{list(self.shape)} ({expected} bytes)",
                field="length",
            )
        if self.offset < 0:
            raise InvalidArgument(f"tensor {self.name!r} has a negative offset", field="offset")
        if self.is_inline:
            if len(self.inline_data) != self.length:
                raise InvalidArgument(
                    f"tensor {self.name!r}: inline data is {len(self.inline_data)} bytes, "
                    f"expected {self.length}",
                    field="inline_data",
                )
        elif self.inline_data:
            raise InvalidArgument(
                f"tensor {self.name!r} has both a key and inline data", field="inline_data"
            )

    @property
    def is_inline(self) -> bool:
        return not self.key
