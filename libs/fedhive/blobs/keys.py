"""Content keys: where a tensor's bytes live, named by their hash (DESIGN §5).

A job's non-inline tensors are objects `{prefix}blake3/<64 hex>`, one per distinct content,
under the job's tensor prefix (`Names.job_tensor_prefix`). A key is never given other bytes,
so a ref can never point at a mix of rounds, and a tensor that did not change between rounds
is the same object: uploaded once per job, and recognised by a trainer's `TensorCache`.
Checkpoints written while sha256 named objects hold `{prefix}sha256/<64 hex>` keys; those are
still read (`fedhive.blobs.checksum`).
"""

from __future__ import annotations

import re

from fedhive.blobs.checksum import ALGORITHMS
from fedhive.errors import InvalidArgument

_ALGORITHM = "|".join(ALGORITHMS)
_CHECKSUM = re.compile(rf"^({_ALGORITHM}):([0-9a-f]{{64}})$")
# a content key's last two parts, as `content_key` writes them
CONTENT_KEY_TAIL = re.compile(rf"(?:^|/)({_ALGORITHM})/([0-9a-f]{{64}})$")


def content_key(prefix: str, checksum: str) -> str:
    """The key of the object holding the bytes with this checksum; InvalidArgument for a
    checksum that is not `blake3:<64 lowercase hex>` (or a checkpoint's `sha256:`)."""
    match = _CHECKSUM.match(checksum)
    if match is None:
        raise InvalidArgument(f"checksum {checksum[:80]!r} is not 'blake3:<64 hex digits>'",
                              field="checksum")
    return f"{prefix}{match.group(1)}/{match.group(2)}"
