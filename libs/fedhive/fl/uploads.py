"""What a site of a job may write, read and reference in the job's object store: the server
job's upload grants, their completion, re-signed URLs, and the check of the refs a result names.
`fedhive.fl.task_server` owns one `Uploads` and hands it the requests below; it records here
each task it assigns (`assigned`) and closes it when the site's result comes (`closed`).

* Open tasks: a task assigned to a site, until its result comes, with the objects its data
  named. Only for those does a site get upload grants, relay another site's upload, or read.
* `GrantUploadRequest`: upload targets for the given checksums, for a task the SJ assigned to
  that site and whose result has not come yet (else PermissionDenied). `present` (nothing to
  upload) when the task's data handed the site the server's object of that content (a layer
  the site did not change) and it exists, or the site's own earlier upload of it exists;
  otherwise the site's upload key for that task, the only kind of key a site is ever
  granted. With `sizes`, an array larger than `upload_part_size` gets a multipart grant
  (upload id, one presigned PUT per part), which the site completes with
  `CompleteUploadRequest`; smaller ones a write-once presigned PUT (`write_once`: signed with
  `If-None-Match: *`, so S3 refuses it once the key holds an object, and the site cannot
  rewrite what it uploaded while the URL lives, e.g. after the next site of a relay or a
  cross-site evaluation was handed it). Unfinished multipart uploads of a task are aborted
  when the site's result for it arrives.
* `CompleteUploadRequest`: complete a multipart upload this SJ granted to that site for that
  key (anything else: PermissionDenied), write-once (S3's conditional write: the parts' URLs
  die with the upload, and no second upload can replace the object); the object must then
  have the granted size.
* `ResignRequest`: fresh presigned GET URLs (a ref whose URL expired while a trainer worked),
  only for keys the SJ handed that site in the data of a task still awaiting its result, or
  that site's own uploads; anything else is PermissionDenied (another site's result is private
  to it, even when its key leaked).
* A result's refs: a non-inline ref names the key of its own checksum (`fedhive.blobs.keys`)
  in one of three places only: the server's object (`{tensor prefix}blake3/<hex>`, which no
  site can write), the site's own upload (`{tensor prefix}sites/<site>/<task>/blake3/<hex>`,
  any of its tasks), or another site's upload that the server handed this site in this task's
  data (a relay: the cyclic workflow's next site sending back what it was given). So a result
  can never make the server read what another site may still write, and a failing object is
  blamed on the site its key names. Its URL is dropped (a site must not choose the URL other
  sites will read). A non-inline ref must also name an object that exists with the ref's
  length (one HEAD per ref; the bytes' checksum is verified whenever the SJ reads them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from fedhive.blobs import TensorRef, content_key
from fedhive.blobs.keys import parse_upload_key, upload_key, uploaded_by
from fedhive.blobs.transfer import MiB
from fedhive.errors import (
    AlreadyExists,
    BlobNotFound,
    FailedPrecondition,
    FedhiveError,
    InvalidArgument,
    PermissionDenied,
)
from fedhive.fl.dxo import Dxo
from fedhive.fl.workflow import WorkflowContext
from fedhive.proto.v1 import common_pb2, task_pb2

URL_TTL_S = 3600
MAX_GRANT = 10_000  # checksums per GrantUploadRequest, keys per ResignRequest
UPLOAD_PART_SIZE = 64 * MiB  # larger arrays are uploaded multipart, in parts of this size
MAX_URL_TTL_S = 7 * 24 * 3600
_ASSIGNED_MEMORY = 10_000  # open assignments remembered (upload grants, relays, messages)
_UPLOADS_MEMORY = 100_000  # (site, checksum) -> the site's upload key, for present answers


class Uploads:
    """One job's upload grants, open tasks and site uploads (see the module doc)."""

    def __init__(self, ctx: WorkflowContext, *, url_ttl_s: int = URL_TTL_S,
                 upload_part_size: int = UPLOAD_PART_SIZE, check_workers: int = 8) -> None:
        assert ctx.store is not None
        self.ctx = ctx
        self._store = ctx.store
        self._url_ttl_s = url_ttl_s
        self._part_size = upload_part_size
        self._check_workers = check_workers
        self._lock = threading.Lock()  # guards the three maps below: handler threads share them
        self._multipart: dict[tuple[str, str, str], _Upload] = {}  # (site, key, upload id)
        self._assigned: OrderedDict[str, _Assigned] = OrderedDict()  # client task id ->
        self._uploads: OrderedDict[tuple[str, str], str] = OrderedDict()

    # open tasks ---------------------------------------------------------------------------
    def assigned(self, task_id: str, site: str, name: str, round_: int | None,
                 keys: frozenset[str]) -> None:
        """`task_id` went to `site` with data naming `keys`: open until its result comes."""
        with self._lock:
            self._assigned[task_id] = _Assigned(site, name, round_, keys)
            self._assigned.move_to_end(task_id)
            while len(self._assigned) > _ASSIGNED_MEMORY:
                self._assigned.popitem(last=False)

    def closed(self, site: str, task_id: str) -> None:
        """`site`'s result for `task_id` came: its unfinished multipart uploads are aborted, and
        no more grants, relays or messages for it."""
        self._abort_uploads(site, task_id)
        with self._lock:
            assigned = self._assigned.get(task_id)
            if assigned is not None and assigned.site == site:
                del self._assigned[task_id]

    def where(self, site: str, task_id: str) -> str:
        """"job J site S task T round R" for messages about a site's result."""
        with self._lock:
            assigned = self._assigned.get(task_id)
        where = f"job {self.ctx.job_id} site {site}"
        if assigned is not None and assigned.site == site:
            where += f" task {assigned.name!r}"
            if assigned.round is not None:
                where += f" round {assigned.round}"
        return where

    # requests -----------------------------------------------------------------------------
    def grant_upload(self, site: str, checksums: list[str], sizes: list[int] | None = None,
                     task_id: str = "") -> task_pb2.UploadGrant:
        """Where to put each array: `present`, or at the site's upload key for `task_id` a
        presigned PUT or (an array above the part size, when `sizes` are given) a multipart
        grant."""
        handed = self._open(site, task_id)
        if len(checksums) > MAX_GRANT:
            raise InvalidArgument(f"{len(checksums)} checksums in one grant request (at most "
                                  f"{MAX_GRANT})", field="checksums")
        if sizes and len(sizes) != len(checksums):
            raise InvalidArgument(f"{len(sizes)} sizes for {len(checksums)} checksums",
                                  field="sizes")
        grant = task_pb2.UploadGrant()
        multipart = 0
        for index, checksum in enumerate(checksums):
            size = sizes[index] if sizes else 0
            if size < 0:
                raise InvalidArgument(f"size {size} of {checksum[:24]}... is negative",
                                      field="sizes")
            present = self._present(site, handed, checksum, size if sizes else None)
            key = present or upload_key(self.ctx.tensor_prefix, site, task_id, checksum)
            target = grant.targets.add(checksum=checksum, key=key, present=bool(present))
            self._remember(site, checksum, key)
            if present:
                continue
            if size > self._part_size:
                multipart += 1
                parts = self._store.presign_multipart(key, size, self._part_size,
                                                      _upload_ttl(size))
                target.upload_id, target.part_size = parts.upload_id, parts.part_size
                target.part_urls.extend(url.url for url in parts.urls)
                target.url_expires_at_ms = min(url.expires_at_ms for url in parts.urls)
                with self._lock:
                    self._multipart[(site, key, parts.upload_id)] = _Upload(task_id, size)
            else:
                url = self._store.presign_put(key, _upload_ttl(size), write_once=True)
                target.url, target.url_expires_at_ms = url.url, url.expires_at_ms
                target.write_once = True
        self.ctx.log.debug("task_server.upload_granted", site=site, objects=len(checksums),
                           multipart=multipart)
        return grant

    def complete_upload(self, site: str, message: task_pb2.CompleteUploadRequest,
                        ) -> common_pb2.Ack:
        ident = (site, message.key, message.upload_id)
        with self._lock:
            upload = self._multipart.pop(ident, None)
        if upload is None:
            raise PermissionDenied(f"job {self.ctx.job_id}: no multipart upload "
                                   f"{message.upload_id[:40]!r} of {message.key[:200]!r} was "
                                   f"granted to site {site!r}", field="upload_id")
        try:
            self._store.complete_multipart(message.key, message.upload_id, list(message.etags),
                                           write_once=True)
        except AlreadyExists:  # the site wrote its own key before: the size check judges it
            self._store.abort_multipart(message.key, message.upload_id)
        except FedhiveError:
            self._store.abort_multipart(message.key, message.upload_id)
            raise
        stored = self._store.size(message.key)
        if stored != upload.size:
            self._store.delete(message.key)
            raise InvalidArgument(f"job {self.ctx.job_id} site {site}: upload of "
                                  f"{message.key[:200]} holds {stored} bytes, {upload.size} "
                                  "were granted", field="etags")
        self.ctx.log.debug("task_server.upload_completed", site=site, key=message.key)
        return common_pb2.Ack()

    def resign(self, site: str, keys: list[str]) -> task_pb2.ResignReply:
        if len(keys) > MAX_GRANT:
            raise InvalidArgument(f"{len(keys)} keys in one resign request (at most "
                                  f"{MAX_GRANT})", field="keys")
        prefix = self.ctx.tensor_prefix
        with self._lock:
            handed = [assigned.keys for assigned in self._assigned.values()
                      if assigned.site == site]
        reply = task_pb2.ResignReply()
        for key in keys:
            if self.ctx.is_foreign(key):
                raise FailedPrecondition(
                    f"job {self.ctx.job_id}: key {key[:200]!r} is an upper tier's object; its "
                    "URL came with the task and cannot be renewed here", field="keys")
            upload = parse_upload_key(prefix, key)
            if not ((upload is not None and upload.site == site)
                    or any(key in given for given in handed)):
                self.ctx.log.warning("task_server.resign_refused", site=site, key=key[:200])
                raise PermissionDenied(f"job {self.ctx.job_id}: key {key[:200]!r} is neither in "
                                       f"the data of an open task of site {site!r} nor its "
                                       "upload: no URL", field="keys")
            url = self._store.presign_get(key, self._url_ttl_s)
            reply.urls.add(key=key, url=url.url, url_expires_at_ms=url.expires_at_ms)
        self.ctx.log.debug("task_server.resigned", site=site, objects=len(keys))
        return reply

    def checked(self, dxo: Dxo, site: str, task_id: str) -> Dxo:
        """`site`'s result data for `task_id`: refs it may send (see the module doc), URL
        dropped, naming objects that exist with the refs' lengths; else InvalidArgument."""
        with self._lock:
            assigned = self._assigned.get(task_id)
        handed = assigned.keys if assigned is not None and assigned.site == site else frozenset()
        prefix = self.ctx.tensor_prefix
        for name, ref in list(dxo.data.items()):
            if not isinstance(ref, TensorRef) or ref.is_inline:
                continue
            upload = parse_upload_key(prefix, ref.key)
            if ref.offset or not (ref.key == content_key(prefix, ref.checksum) or (
                    upload is not None and upload.checksum == ref.checksum
                    and (upload.site == site or ref.key in handed))):
                raise InvalidArgument(f"tensor {name!r}: key {ref.key[:200]!r} is not the "
                                      "server's object of its checksum, nor the site's own "
                                      "upload of it, nor one its task handed it", field=name)
            dxo.data[name] = replace(ref, url="", url_expires_at_ms=0)
        self._check_objects(dxo)
        return dxo


    # internals ----------------------------------------------------------------------------
    def _stored(self, key: str, size: int | None) -> bool:
        """The object is there (with `size` bytes, when known): nothing to upload. One of the
        wrong size is damaged: not counted."""
        try:
            stored = self._store.size(key)
        except BlobNotFound:
            return False
        if size is not None and stored != size:
            self.ctx.log.warning("task_server.damaged_object", key=key, size=stored,
                                 expected=size)
            return False
        return True

    def _present(self, site: str, handed: frozenset[str], checksum: str, size: int | None,
                 ) -> str:
        """The key of an object with this content that `site`'s result may name, '' for none:
        the server's own that its task handed it (frozen layers, the global model sent back)
        or the site's own earlier upload. Never another site's: that site could still write it.
        Other content is new (what the site trained): no HEAD is spent looking for it."""
        server = content_key(self.ctx.tensor_prefix, checksum)
        if server in handed and self._stored(server, size):
            return server
        with self._lock:
            own = self._uploads.get((site, checksum), "")
        return own if own and self._stored(own, size) else ""

    def _remember(self, site: str, checksum: str, key: str) -> None:
        """`site` uploads (or has) `checksum` at `key`: its later grants may answer present."""
        if parse_upload_key(self.ctx.tensor_prefix, key) is None:
            return  # the server's object: found by its name
        with self._lock:
            self._uploads[(site, checksum)] = key
            self._uploads.move_to_end((site, checksum))
            while len(self._uploads) > _UPLOADS_MEMORY:
                self._uploads.popitem(last=False)

    def _open(self, site: str, task_id: str) -> frozenset[str]:
        """Upload grants are for a task assigned to `site` whose result is not in yet; the
        keys its data named."""
        with self._lock:
            assigned = self._assigned.get(task_id)
        if assigned is None or assigned.site != site:
            raise PermissionDenied(f"job {self.ctx.job_id}: task {task_id[:80]!r} is not a "
                                   f"task of site {site!r} awaiting its result: no upload "
                                   "grant", field="task_id")
        return assigned.keys

    def _check_objects(self, dxo: Dxo) -> None:
        """Every uploaded ref names an object that exists with the ref's length."""
        refs = [ref for ref in dxo.refs() if not ref.is_inline]
        if not refs:
            return

        def check(ref: TensorRef) -> str:
            where = f"tensor {ref.name!r}: object {ref.key}{uploaded_by(ref.key)}"
            try:
                size = self._store.size(ref.key)
            except BlobNotFound:
                return f"{where} is missing"
            if size != ref.length:
                return f"{where} holds {size} bytes, the ref says {ref.length}"
            return ""

        if len(refs) == 1:  # the common result: no thread to start
            found = [check(refs[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(self._check_workers, len(refs))) as pool:
                found = list(pool.map(check, refs))
        problems = [problem for problem in found if problem]
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise InvalidArgument(problems[0] + more, field="data")

    def _abort_uploads(self, site: str, task_id: str) -> None:
        """Multipart uploads granted for this task and never completed: dropped."""
        with self._lock:
            stale = [ident for ident, upload in self._multipart.items()
                     if ident[0] == site and upload.task_id == task_id]
            for ident in stale:
                del self._multipart[ident]
        for _, key, upload_id in stale:
            try:
                self._store.abort_multipart(key, upload_id)
            except FedhiveError as err:
                self.ctx.log.warning("task_server.abort_upload_failed", key=key, error=str(err))


def _upload_ttl(size: int) -> int:
    """An upload URL's lifetime: an hour, plus a second per MiB (a slow link still finishes)."""
    return min(URL_TTL_S + size // MiB, MAX_URL_TTL_S)


@dataclass(frozen=True)
class _Assigned:
    """A task assigned to a site, until its result comes."""

    site: str
    name: str
    round: int | None
    # the objects its data names: the site may read them (resign) and send back another
    # site's upload among them (a relay)
    keys: frozenset[str]


@dataclass(frozen=True)
class _Upload:
    task_id: str
    size: int
