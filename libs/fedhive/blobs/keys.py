"""Tensor object keys: where a tensor's bytes live, named by their hash (DESIGN §5), and who
wrote them.

Under a job's tensor prefix (`Names.job_tensor_prefix`), three areas, each written by one
party only:

* `{prefix}blake3/<64 hex>` (`content_key`): the server job's objects (task data, aggregates,
  checkpointed arrays), one per distinct content. No site is ever granted a write here, so a
  ref to such a key holds what its name says.
* `{prefix}sites/<site>/<task id>/blake3/<64 hex>` (`upload_key`): what a site uploaded for
  one of its tasks. The only keys a site is granted writes to: its own, for the task it works
  on, and each once only (write-once PUTs and multipart completions: it cannot change what a
  reader was handed). A failure of such an object is that site's (`uploaded_by`), whoever
  reads it. The server keeps none in a model of its own (`ModelStore.adopt`).
* `{prefix}checkpoint/blake3/<64 hex>` (`checkpoint_copy_key`): the checkpoint's copies of
  site objects (`fedhive.fl.checkpoint`), written and deleted by the checkpoint only.

A key is never given other bytes by its writer, so a ref can never point at a mix of rounds,
and a tensor that did not change between rounds is the same server object: uploaded once per
job, and recognised by a trainer's `TensorCache`. Checkpoints written while sha256 named
objects hold `{prefix}sha256/<64 hex>` keys; those are still read (`fedhive.blobs.checksum`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from fedhive.blobs.checksum import ALGORITHMS
from fedhive.blobs.ref import TensorRef
from fedhive.errors import FedhiveError, InvalidArgument

_ALGORITHM = "|".join(ALGORITHMS)
_CHECKSUM = re.compile(rf"^({_ALGORITHM}):([0-9a-f]{{64}})$")
_NAME = r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}"  # a site name, a task id: one key segment
_SEGMENT = re.compile(rf"^{_NAME}$")
SITES_AREA = "sites/"
CHECKPOINT_AREA = "checkpoint/"
# a content key's last two parts, as every key above ends
CONTENT_KEY_TAIL = re.compile(rf"(?:^|/)({_ALGORITHM})/([0-9a-f]{{64}})$")
_UPLOAD_TAIL = re.compile(
    rf"(?:^|/){SITES_AREA}({_NAME})/({_NAME})/({_ALGORITHM})/([0-9a-f]{{64}})$")


def _hashed(checksum: str) -> str:
    """`<algorithm>/<hex>` of a checksum; InvalidArgument for one that is not
    `blake3:<64 lowercase hex>` (or a checkpoint's `sha256:`)."""
    match = _CHECKSUM.match(checksum)
    if match is None:
        raise InvalidArgument(f"checksum {checksum[:80]!r} is not 'blake3:<64 hex digits>'",
                              field="checksum")
    return f"{match.group(1)}/{match.group(2)}"


def content_key(prefix: str, checksum: str) -> str:
    """The server's object holding the bytes with this checksum."""
    return f"{prefix}{_hashed(checksum)}"


def upload_key(prefix: str, site: str, task_id: str, checksum: str) -> str:
    """Where `site` uploads the bytes with this checksum for its task `task_id`."""
    for name, value in (("site", site), ("task_id", task_id)):
        if not _SEGMENT.match(value):
            raise InvalidArgument(f"{name} {value[:80]!r} cannot name an upload key",
                                  field=name)
    return f"{upload_prefix(prefix, site)}{task_id}/{_hashed(checksum)}"


def upload_prefix(prefix: str, site: str) -> str:
    """Everything `site` uploaded for the job of tensor prefix `prefix`."""
    return f"{prefix}{SITES_AREA}{site}/"


def checkpoint_copy_key(prefix: str, checksum: str) -> str:
    """The checkpoint's own copy of the bytes with this checksum."""
    return f"{prefix}{CHECKPOINT_AREA}{_hashed(checksum)}"


@dataclass(frozen=True)
class Upload:
    """What an upload key says: the site that wrote it, for which task, which content."""

    site: str
    task_id: str
    checksum: str


def parse_upload_key(prefix: str, key: str) -> Upload | None:
    """The site, task and checksum of an upload key under `prefix`; None for any other key."""
    if not key.startswith(prefix):
        return None
    match = _UPLOAD_TAIL.match(key[len(prefix):])
    if match is None:
        return None
    site, task_id, algorithm, hexdigest = match.groups()
    return Upload(site, task_id, f"{algorithm}:{hexdigest}")


def uploader_of(key: str) -> str | None:
    """The site whose upload `key` is (read from the key alone, as a trainer without the job's
    prefix can), None for the server's objects."""
    match = _UPLOAD_TAIL.search(key)
    return match.group(1) if match else None


def uploaded_by(key: str) -> str:
    """' (uploaded by site S)' for a site's upload, '' otherwise: added to a message about an
    object so that a failure is blamed on whoever wrote it."""
    site = uploader_of(key)
    return f" (uploaded by site {site})" if site else ""


def blame_uploader(err: FedhiveError, refs: Iterable[TensorRef]) -> FedhiveError | None:
    """`err`, about one of `refs` (its `field` names the tensor or the object's key), again with
    the site that uploaded that object named (`uploaded_by`); None when the object is no site's
    upload or `err` is about none of `refs`."""
    for ref in refs:
        if ref.key and err.field in (ref.name, ref.key):
            site = uploaded_by(ref.key)
            return type(err)(f"{err.message}{site}", field=err.field) if site else None
    return None
