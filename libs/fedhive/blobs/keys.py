"""Content keys: where a tensor's bytes live, named by their hash (DESIGN §5).

A job's non-inline tensors are objects `{prefix}sha256/<64 hex>`, one per distinct content,
under the job's tensor prefix (`Names.job_tensor_prefix`). A key is never given other bytes,
so a ref can never point at a mix of rounds, and a tensor that did not change between rounds
is the same object: uploaded once per job, and recognised by a trainer's `TensorCache`.
"""

from __future__ import annotations

import re

from fedhive.errors import InvalidArgument

_SHA256 = re.compile(r"^sha256:([0-9a-f]{64})$")


def content_key(prefix: str, checksum: str) -> str:
    """The key of the object holding the bytes with this checksum; InvalidArgument for a
    checksum that is not `sha256:<64 lowercase hex>`."""
    match = _SHA256.match(checksum)
    if match is None:
        raise InvalidArgument(f"checksum {checksum[:80]!r} is not 'sha256:<64 hex digits>'",
                              field="checksum")
    return f"{prefix}sha256/{match.group(1)}"
