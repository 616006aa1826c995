"""Checkpoints: a job's global model after its last completed round, kept in S3 for resume.

    save_checkpoint(ctx, Checkpoint("ScatterAndGather", round_=3, num_rounds=10, model=dxo))
    checkpoint = load_checkpoint(ctx, old_job_id)   # None when that job wrote none
    checkpoint_keys(ctx)                            # the objects this job's checkpoint names

One object per job, `Names.job_checkpoint_key(job_id)`: a `TensorBundle` whose meta holds the
workflow, the round and the model's kind and meta, and whose refs are the model's: the
workflows keep the global model as refs to the job's content-addressed tensor objects, and the
checkpoint names those same objects when they are the server's (no bytes are copied; URLs are
dropped: a checkpoint is read with credentials). Arrays, when a caller checkpoints some, are
stored first, at their content keys under the job's tensor prefix (small ones inline in the
bundle).

A checkpoint never names an object a site uploaded: the workflows' global models name none
(`ModelStore.as_refs`), but a caller may checkpoint a site's result as it came, and an upload
key is the site's (`fedhive.blobs.keys`: were its write-once URL not honoured by the store,
what it wrote there later would become the server's). Such a tensor is named at the server's
object of its content when there is one, else read (checksum verified; a failure names the
site) and copied to the checkpoint's own key `{prefix}checkpoint/blake3/<hex>`, which only the
checkpoint writes and deletes: a new checkpoint deletes the copies the one before named and it
does not.

Otherwise a checkpoint deletes no tensor object: the round objects' collector
(`ModelStore.collect`) keeps every object `checkpoint_keys` names, so a crash at any point
leaves a checkpoint whose objects all exist. The server job is the only writer of its job's
checkpoint, so the keys it last wrote (or read, once, when it started) are remembered in the
context (`ctx.checkpointed`) instead of read back each round; unknown again while a write is
in flight (a failed one may or may not have landed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from fedhive.blobs import TensorRef, bundle_from_proto, bundle_to_proto, content_key
from fedhive.blobs.keys import CHECKPOINT_AREA, checkpoint_copy_key, parse_upload_key, uploaded_by
from fedhive.blobs.transfer import as_byte_view
from fedhive.errors import BlobNotFound, FailedPrecondition, FedhiveError
from fedhive.fl.dxo import DataKind, Dxo
from fedhive.fl.model_store import ModelStore, ModelWriter
from fedhive.names import Names
from fedhive.proto.v1 import common_pb2

if TYPE_CHECKING:
    from fedhive.blobs import BlobStore
    from fedhive.fl.workflow import WorkflowContext

@dataclass(frozen=True)
class Checkpoint:
    workflow: str  # the workflow class that wrote it
    round_: int  # the last completed round (0-based)
    num_rounds: int  # the workflow's total rounds
    model: Dxo  # lazy (refs) when loaded


def job_names(ctx: WorkflowContext) -> Names:
    if ctx.names is None:
        raise FailedPrecondition("the workflow context has no names", field="names")
    return ctx.names


def _store(ctx: WorkflowContext) -> BlobStore:
    if ctx.store is None:
        raise FailedPrecondition("the workflow context has no blob store", field="store")
    return ctx.store


def save_checkpoint(ctx: WorkflowContext, checkpoint: Checkpoint) -> None:
    store, names = _store(ctx), job_names(ctx)
    if ctx.codec is None:
        raise FailedPrecondition("the workflow context has no tensor codec", field="codec")
    model = checkpoint.model
    models = ModelStore.of(ctx)
    writer = models.writer() if not all(
        isinstance(value, TensorRef) for value in model.data.values()) else None
    refs = [_servers(ctx, models, value) if isinstance(value, TensorRef)
            else _put(writer, name, value) for name, value in model.data.items()]
    meta = {"workflow": checkpoint.workflow, "round": checkpoint.round_,
            "num_rounds": checkpoint.num_rounds, "data_kind": model.data_kind.value,
            "model_meta": model.meta}
    previous = checkpoint_keys(ctx)
    ctx.checkpointed = None  # unknown until the new bundle is stored
    bundle = bundle_to_proto(refs, meta).SerializeToString()
    store.put(names.job_checkpoint_key(ctx.job_id), bundle)
    ctx.checkpointed = {ref.key for ref in refs if ref.key}
    _drop_copies(ctx, store, previous - ctx.checkpointed)
    ctx.log.info("checkpoint.saved", workflow=checkpoint.workflow, round=checkpoint.round_,
                 tensors=len(refs), objects=len(ctx.checkpointed))


def _servers(ctx: WorkflowContext, models: ModelStore, ref: TensorRef) -> TensorRef:
    """`ref` as the checkpoint names it: without its URL (URLs expire and are for sites; a
    checkpoint is read with credentials) and, when a site uploaded its object, pointed at the
    server's object of that content or at the checkpoint's copy."""
    bare = replace(ref, url="", url_expires_at_ms=0)
    prefix = ctx.tensor_prefix
    if ref.is_inline or parse_upload_key(prefix, ref.key) is None:
        return bare
    copy = checkpoint_copy_key(prefix, ref.checksum)
    for key in (content_key(prefix, ref.checksum), copy):
        if _holds(models, key, ref.length):
            return replace(bare, key=key, offset=0)
    try:
        array = models.fetch(ref)
    except FedhiveError as err:
        raise type(err)(f"checkpoint of job {ctx.job_id}: {err.message}{uploaded_by(ref.key)}",
                        field=ref.name) from err
    models.store.put(copy, [as_byte_view(array)])
    return replace(bare, key=copy, offset=0)


def _holds(models: ModelStore, key: str, size: int) -> bool:
    try:
        return models.store.size(key) == size
    except BlobNotFound:
        return False


def _drop_copies(ctx: WorkflowContext, store: BlobStore, keys: set[str]) -> None:
    """Delete the checkpoint's copies among `keys` (no longer named); a failed delete costs
    space only."""
    area = f"{ctx.tensor_prefix}{CHECKPOINT_AREA}"
    copies = sorted(key for key in keys if key.startswith(area))
    if not copies:
        return
    try:
        store.delete(*copies)
    except FedhiveError as err:
        ctx.log.warning("checkpoint.delete_failed", objects=len(copies), error=str(err))


def _put(writer: ModelWriter | None, name: str, value: Any) -> TensorRef:
    assert writer is not None
    return writer.put(name, value)


def checkpoint_keys(ctx: WorkflowContext) -> set[str]:
    """The objects this job's checkpoint names (empty when it has none): read once (a job
    that checkpoints rarely or never asked S3 every round), then remembered, as its only
    writer may."""
    if ctx.checkpointed is None:
        try:
            message = common_pb2.TensorBundle.FromString(
                _store(ctx).get(job_names(ctx).job_checkpoint_key(ctx.job_id)))
        except BlobNotFound:
            ctx.checkpointed = set()
        else:
            ctx.checkpointed = {ref.key for ref in message.tensors if ref.key}
    return set(ctx.checkpointed)


def load_checkpoint(ctx: WorkflowContext, job_id: str) -> Checkpoint | None:
    """Job `job_id`'s checkpoint (same deployment as `ctx`), or None when it wrote none."""
    store = _store(ctx)
    key = job_names(ctx).job_checkpoint_key(job_id)
    try:
        raw = store.get(key)
    except BlobNotFound:
        return None
    refs, meta = bundle_from_proto(common_pb2.TensorBundle.FromString(raw))
    try:
        model = Dxo(DataKind(meta["data_kind"]), {ref.name: ref for ref in refs},
                    dict(meta.get("model_meta") or {}))
        return Checkpoint(str(meta["workflow"]), _whole(meta["round"]),
                          _whole(meta["num_rounds"]), model)
    except (KeyError, ValueError, TypeError) as err:
        raise FailedPrecondition(f"checkpoint {key} is malformed: {err!r}",
                                 field="checkpoint") from None


def _whole(value: Any) -> int:
    """Struct numbers come back as floats."""
    if float(value) != int(value):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)
