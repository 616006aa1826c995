"""The server job's models in S3: read and written one tensor at a time, content-addressed.

Between rounds a workflow keeps the global model as refs (a lazy `Dxo`); the server job never
holds a whole model, only the few tensors it is working on:

    models = ModelStore.of(ctx)
    writer = models.writer()                # one model's inline budget
    ref = writer.put("w", array)            # stored at {prefix}blake3/<hex> (once), or inline
    array = models.fetch(ref)               # checksum verified; numpy, bfloat16 as its bits
    model = models.pack(items)              # (name, array) pairs -> a lazy Dxo, one at a time
    model = models.as_refs(model)           # arrays packed, the server's refs kept, sites'
                                            # uploads and another job's refs (a resumed
                                            # checkpoint) pointed at the server's objects
    models.track(result)                    # objects a round made or received
    models.collect([model], protect=keys)   # delete the tracked objects nothing needs now

Objects: a stored tensor lives at `content_key(tensor prefix, checksum)`, is never overwritten
with other bytes and is shared by every ref to the same content (a frozen layer is one object
for the whole job). A model made by `pack`/`as_refs` (every workflow's global model) names only
the server's objects, never a site's upload (`fedhive.blobs.keys`: its key is the site's to
write, and its failures the site's), whatever a workflow or a custom aggregator handed in.
Deleting is by reference: `collect` deletes the tracked keys (sites' uploads among them) that
no live model and no protected set (the job's checkpoint) names, and only keys under this job's
tensor prefix; another job's objects (the checkpoint a job resumed from) are never touched.

Arithmetic helpers (`compute_dtype`, `to_compute`, `from_compute`) define how the server adds
tensors: half precision (float16, bfloat16) in float32, integers and bool in float64, the rest
in their own dtype; results go back to the tensor's dtype (bfloat16 rounded to nearest even).

Memory: creating a ModelStore bounds glibc's heap (`fedhive.heap.bound_heap`: tensor buffers
get mappings of their own, returned when freed); the workflows run `fedhive.heap.release_memory`
after a round of a large model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from fedhive.blobs import TensorKind, TensorRef, checksum, content_key, inline_budget_for, unpack
from fedhive.blobs.dtypes import (
    bfloat16_bits_to_float32,
    bytes_to_numpy,
    is_torch_tensor,
    itemsize,
    numpy_to_bytes,
    torch_to_bytes,
)
from fedhive.blobs.keys import parse_upload_key, uploaded_by
from fedhive.blobs.transfer import MiB, as_byte_view
from fedhive.errors import BlobNotFound, FailedPrecondition, FedhiveError, InvalidArgument
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.heap import bound_heap

if TYPE_CHECKING:
    from fedhive.blobs import BlobStore
    from fedhive.fl.workflow import WorkflowContext

Array = npt.NDArray[Any]
DEFAULT_INLINE_THRESHOLD = 2 * MiB  # fedhive.config.Settings.inline_threshold's default


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor is, without its bytes: the wire dtype name, shape and kind."""

    dtype: str
    shape: tuple[int, ...]
    kind: TensorKind

    @classmethod
    def of(cls, name: str, value: Any) -> TensorSpec:
        """The spec of a ref, numpy array or torch tensor; InvalidArgument for anything else."""
        if isinstance(value, TensorRef):
            return cls(value.dtype, tuple(value.shape), value.kind)
        if is_torch_tensor(value):
            return cls(str(value.dtype).removeprefix("torch."),
                       tuple(int(d) for d in value.shape), TensorKind.TORCH)
        if isinstance(value, np.ndarray | np.generic):
            array = np.asarray(value)
            return cls(array.dtype.name, tuple(array.shape), TensorKind.NUMPY)
        raise InvalidArgument(f"tensor {name!r} is a {type(value).__name__}, not an array",
                              field=name)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype, "")

    def mismatch(self, other: TensorSpec) -> str:
        """'' when `other` may stand in for this tensor, else what differs (shape, dtype)."""
        if other.shape != self.shape:
            return f"has shape {other.shape}, the global model's is {self.shape}"
        if other.dtype != self.dtype:
            return f"has dtype {other.dtype}, the global model's is {self.dtype}"
        return ""


# -- arithmetic ---------------------------------------------------------------------------------

_OWN = frozenset({"float32", "float64", "complex64", "complex128"})
_HALF = frozenset({"float16", "bfloat16"})


def compute_dtype(dtype: str) -> np.dtype[Any]:
    """The dtype the server adds tensors of wire dtype `dtype` in."""
    if dtype in _OWN:
        return np.dtype(dtype)
    return np.dtype(np.float32) if dtype in _HALF else np.dtype(np.float64)


def storage_of(name: str, value: Any) -> tuple[Array, str]:
    """A numpy view of an array's stored form (bfloat16 as uint16 bits) and its wire dtype."""
    if is_torch_tensor(value):
        flat, dtype = torch_to_bytes(name, value)
        return bytes_to_numpy(flat, dtype, tuple(int(d) for d in value.shape)), dtype
    array = np.asarray(value)
    flat, dtype = numpy_to_bytes(name, array)
    return bytes_to_numpy(flat, dtype, tuple(array.shape)), dtype


def to_compute(storage: Array, dtype: str, *, owned: bool) -> Array:
    """`storage` (of wire dtype `dtype`) as a writable array in its compute dtype; a copy
    unless `owned` (the caller's buffer, free to overwrite) and already of that dtype."""
    if dtype == "bfloat16":
        return bfloat16_bits_to_float32(storage)
    target = compute_dtype(dtype)
    if storage.dtype == target:
        return storage if owned and storage.flags.writeable else storage.copy()
    return storage.astype(target)


def from_compute(values: Array, dtype: str) -> Array:
    """Compute-dtype `values` in the stored form of wire dtype `dtype` (bfloat16: its bits,
    rounded to nearest even; integers truncated, as numpy casts)."""
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)
        narrow = rounded.astype(np.uint16)
        nans = np.isnan(values)
        if nans.any():
            narrow[nans] = ((bits[nans] >> 16) | np.uint32(0x40)).astype(np.uint16)
        return narrow
    return values.astype(np.dtype(dtype).newbyteorder("<"), copy=False)


# -- the store ----------------------------------------------------------------------------------


def _keys(models: Iterable[Dxo | TensorRef]) -> set[str]:
    keys: set[str] = set()
    for item in models:
        refs = [item] if isinstance(item, TensorRef) else item.refs()
        keys.update(ref.key for ref in refs if ref.key)
    return keys


class ModelStore:
    """One job's tensors in S3, for the server job. Thread-safe."""

    def __init__(self, store: BlobStore, prefix: str, *, job_id: str, log: Any,
                 inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
                 inline_budget: int | None = None, workers: int = 8,
                 part_size: int = 8 * MiB) -> None:
        if not prefix:
            raise InvalidArgument("tensor prefix is empty", field="prefix")
        self.store = store
        self.prefix = prefix
        self.job_id = job_id
        self.log = log
        self.inline_threshold = max(0, inline_threshold)
        self.inline_budget = inline_budget_for(self.inline_threshold, inline_budget)
        self._workers = workers
        self._part_size = part_size
        self._lock = threading.Lock()
        self._tracked: set[str] = set()
        bound_heap()

    @classmethod
    def of(cls, ctx: WorkflowContext) -> ModelStore:
        """The store of `ctx`'s job; its inline threshold and budget are the codec's, so a
        model the server writes travels like one a site packs."""
        if ctx.store is None or ctx.codec is None:
            raise FailedPrecondition("the workflow context has no blob store or codec",
                                     field="store")
        return cls(ctx.store, ctx.tensor_prefix, job_id=ctx.job_id, log=ctx.log,
                   inline_threshold=ctx.codec.inline_threshold,
                   inline_budget=ctx.codec.inline_budget)

    def owns(self, key: str) -> bool:
        """Is `key` one of this job's tensor objects?"""
        return bool(key) and key.startswith(self.prefix)

    # reading -----------------------------------------------------------------------------------
    def fetch(self, ref: TensorRef) -> Array:
        """The tensor `ref` points at, checksum verified, as a numpy array in its stored form
        (bfloat16: uint16 bits) over a fresh buffer the caller owns. Raises BlobNotFound,
        ChecksumMismatch, ... naming the key and tensor."""
        fetched: Array = unpack([ref], self.store, kind=TensorKind.NUMPY, workers=self._workers,
                                part_size=self._part_size)[ref.name]
        return fetched

    def fetch_value(self, name: str, value: Any) -> tuple[Array, bool]:
        """(stored form, owned) of a ref (fetched) or an array (a view of the caller's)."""
        if isinstance(value, TensorRef):
            return self.fetch(value), True
        storage, _ = storage_of(name, value)
        return storage, False

    # writing -----------------------------------------------------------------------------------
    def writer(self) -> ModelWriter:
        """A writer for one model: it inlines small tensors up to the model's inline budget."""
        return ModelWriter(self)

    def pack(self, items: Iterable[tuple[str, Any]], kind: DataKind = DataKind.WEIGHTS,
             meta: dict[str, Any] | None = None) -> Dxo:
        """A lazy Dxo of `items` (name, array or ref), taken one at a time: each array is
        stored (or inlined) and dropped before the next is asked for; refs go through
        `adopt`."""
        writer = self.writer()
        data: dict[str, TensorRef] = {}
        for name, value in items:
            if isinstance(value, TensorRef):
                data[name] = self.adopt(value, writer)
            else:
                data[name] = writer.put(name, value)
            del value
        return Dxo(kind, data, dict(meta or {}))

    def as_refs(self, model: Dxo) -> Dxo:
        """`model` with arrays stored and every ref this job's (see `pack`)."""
        return self.pack(model.data.items(), model.data_kind, model.meta)

    def adopt(self, ref: TensorRef, writer: ModelWriter | None = None) -> TensorRef:
        """`ref` as a ref to this job's server objects, without a URL (the task server signs
        URLs for the sites): inline refs and the server's own as they are; a site's upload, or
        another job's ref (a resumed job's checkpoint), pointed at this job's object of the same
        content, which is copied (read, checksum verified, stored) when it is not there yet. An
        upload that cannot be read fails naming the site that uploaded it."""
        bare = replace(ref, url="", url_expires_at_ms=0)
        if ref.is_inline:
            return bare
        upload = parse_upload_key(self.prefix, ref.key)
        if upload is None and self.owns(ref.key) and ref.offset == 0:
            self.track(bare)
            return bare
        try:
            key = content_key(self.prefix, ref.checksum)
        except InvalidArgument:
            key = ""
        if key and self._present(key, ref.length):
            own = replace(bare, key=key, offset=0)
            self.track(own)
            return own
        try:
            array = self.fetch(ref)
        except FedhiveError as err:
            if upload is None:
                raise
            raise type(err)(f"{err.message}{uploaded_by(ref.key)}", field=err.field) from err
        return (writer or self.writer()).put(ref.name, array, dtype=ref.dtype, kind=ref.kind,
                                             inline=False)

    def _present(self, key: str, size: int) -> bool:
        try:
            return self.store.size(key) == size
        except BlobNotFound:
            return False

    def store_object(self, key: str, view: memoryview) -> None:
        """Upload `view` to the content key `key` unless an object of its size is there."""
        if not self._present(key, len(view)):
            self.store.put(key, [view])
        with self._lock:
            self._tracked.add(key)

    # round objects -----------------------------------------------------------------------------
    def track(self, *models: Dxo | TensorRef) -> None:
        """Remember the objects of this job that `models` name, to delete them once unused."""
        keys = {key for key in _keys(models) if self.owns(key)}
        with self._lock:
            self._tracked |= keys

    def tracked(self) -> set[str]:
        with self._lock:
            return set(self._tracked)

    def collect(self, live: Iterable[Dxo], protect: Iterable[str] = ()) -> int:
        """Delete the tracked objects that neither a `live` model nor `protect` names (in
        batches: a round's site uploads are one request, not one per site); returns how many
        were deleted. After a failed delete all of them are tried again at the next collect."""
        keep = _keys(live) | set(protect)
        with self._lock:
            doomed = sorted(self._tracked - keep)
            self._tracked &= keep
        if not doomed:
            return 0
        try:
            self.store.delete(*doomed)
        except FedhiveError as err:
            with self._lock:
                self._tracked.update(doomed)
            self.log.warning("models.delete_failed", objects=len(doomed), error=str(err))
            return 0
        self.log.info("models.collected", deleted=len(doomed), kept=len(keep))
        return len(doomed)


class KeptModelStore(ModelStore):
    """`models` for reading; the tensors it writes go to files in `folder` (named by checksum,
    `kept_file`) instead of S3: a result no one in this system reads, which an upper tier copies
    into its own store (`ExportOperationResult`). Nothing here tracks or collects them: the
    folder goes as a whole."""

    def __init__(self, models: ModelStore, folder: Path) -> None:
        super().__init__(models.store, models.prefix, job_id=models.job_id, log=models.log,
                         inline_threshold=models.inline_threshold,
                         inline_budget=models.inline_budget, workers=models._workers,
                         part_size=models._part_size)
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def store_object(self, key: str, view: memoryview) -> None:
        path = kept_file(self.folder, self.prefix, key)
        if path.exists() and path.stat().st_size == len(view):
            return
        partial = path.with_name(f"{path.name}.{threading.get_ident()}.partial")
        with partial.open("wb") as out:
            out.write(view)
        partial.replace(path)


def kept_file(folder: Path, prefix: str, key: str) -> Path:
    """Where a `KeptModelStore` of that tensor prefix keeps the object `key` (a content key:
    `<algorithm>-<hex>`)."""
    return folder / key.removeprefix(prefix).replace("/", "-")


class ModelWriter:
    """Stores the tensors of one model; small ones travel inline while the model's inline
    budget lasts (so a model of many small tensors cannot swell a task message)."""

    def __init__(self, models: ModelStore) -> None:
        self._models = models
        self._lock = threading.Lock()
        self._inline_used = 0

    def put(self, name: str, value: Any, *, dtype: str | None = None,
            kind: TensorKind | None = None, inline: bool = True) -> TensorRef:
        """A ref to `value` (a numpy array, its stored form when `dtype` names another wire
        dtype — bfloat16 bits —, or a torch tensor), inline when small and `inline`, else stored
        at its content key (not uploaded again when it is there)."""
        if is_torch_tensor(value):
            flat, wire = torch_to_bytes(name, value)
            shape, default_kind = tuple(int(d) for d in value.shape), TensorKind.TORCH
        else:
            array = np.asarray(value)
            flat, wire = numpy_to_bytes(name, array)
            shape, default_kind = tuple(array.shape), TensorKind.NUMPY
        digest = checksum.digest(flat)
        size = flat.nbytes
        models = self._models
        with self._lock:
            small = size == 0 or (inline and size <= models.inline_threshold
                                  and self._inline_used + size <= models.inline_budget)
            if small:
                self._inline_used += size
        key = "" if small else content_key(models.prefix, digest)
        if key:
            models.store_object(key, as_byte_view(flat))
        return TensorRef(name=name, dtype=dtype or wire, shape=shape, kind=kind or default_kind,
                         key=key, length=size, checksum=digest,
                         inline_data=flat.tobytes() if small else b"")

