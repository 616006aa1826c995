"""The disk side of `LocalBlobStore`: one bucket's objects as files under a folder.

Layout under `root`: `objects/<key>` (a key's `/`-separated segments are folders), `tmp/`
(files being written: renamed into place only once complete, so no reader ever sees half an
object) and `uploads/<upload id>/` (a multipart upload: `key`, the key it is for, and its parts
`<number>.<md5>`). Keys a file system cannot hold as S3 does are refused (InvalidArgument
naming them): empty, `.` or `..` segments (so no key leaves `objects/`), NUL, over S3's 1024
bytes, and an object whose key is a folder of another object's.

Several processes may share a folder: every change is a rename or a link (atomic), and a
write whose folder a concurrent delete pruned just makes the folder again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from fedhive.blobs.port import Bytes
from fedhive.errors import AlreadyExists, BlobNotFound, FedhiveError, InvalidArgument

CHUNK = 1024 * 1024  # bytes per read when copying: bounds every buffer of a transfer
MIN_PART = 5 * CHUNK  # S3's smallest part (all but the last): kept so grants behave alike
_MAX_KEY = 1024  # S3's longest key, in UTF-8 bytes
_NAME_MAX = 255  # longest file name (one key segment), in bytes
_UPLOAD_ID = re.compile(r"^[0-9a-f]{32}$")
_ETAG = re.compile(r'^"?([0-9a-f]{32})"?$')
_ATTEMPTS = 5  # a write racing deletes that prune its folders makes them again this often


class Folder:
    """The objects, temporary files and multipart uploads of one bucket under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._objects = root / "objects"
        self._tmp = root / "tmp"
        self._uploads = root / "uploads"

    def create(self) -> None:
        for folder in (self._objects, self._tmp, self._uploads):
            folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """Where `key` lives; InvalidArgument for a key no file system path can stand for."""
        segments = key.split("/")
        if not key or len(key.encode()) > _MAX_KEY or "\0" in key:
            reason = "a key of 1 to 1024 bytes without NUL"
        elif any(s in ("", ".", "..") for s in segments):
            reason = "no empty, '.' or '..' path segments (leading, trailing or double '/')"
        elif any(len(s.encode()) > _NAME_MAX for s in segments):
            reason = f"no path segment over {_NAME_MAX} bytes"
        else:
            return self._objects.joinpath(*segments)
        raise InvalidArgument(f"blob key {key!r} cannot be stored in a local folder: it needs "
                              f"{reason}", field=key)

    # --- reading -------------------------------------------------------------------------------
    def open(self, key: str, action: str = "reading") -> io.FileIO:
        """The object's file, unbuffered (readinto fills the caller's buffer directly)."""
        path = self.path(key)
        try:
            file = open(path, "rb", buffering=0)  # noqa: SIM115 - the caller closes it
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:
            raise _not_found(key, action) from err
        except OSError as err:
            raise _disk_failed(key, action, err) from err
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            file.close()
            raise _not_found(key, action)
        return file

    def size(self, key: str) -> int:
        path = self.path(key)
        try:
            info = path.stat()
        except (FileNotFoundError, NotADirectoryError) as err:
            raise _not_found(key, "checking") from err
        except OSError as err:
            raise _disk_failed(key, "checking", err) from err
        if not stat.S_ISREG(info.st_mode):
            raise _not_found(key, "checking")
        return info.st_size

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except BlobNotFound:
            return False
        return True

    # --- writing -------------------------------------------------------------------------------
    def write(self, key: str, chunks: Iterable[Bytes], *, write_once: bool = False) -> None:
        """Store the concatenation of `chunks` at `key`, all or nothing. With `write_once`,
        AlreadyExists when `key` holds an object (then nothing is written)."""
        dest = self.path(key)
        with self._staged(key, "writing") as (file, temp):
            for chunk in chunks:
                file.write(chunk)
            self._commit(temp, dest, key, "writing", write_once)

    def delete(self, key: str) -> None:
        path = self.path(key)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if not path.is_dir():
                path.unlink()
                self._prune(path.parent)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with `prefix` (a string prefix, as in S3)."""
        head, _, _ = prefix.rpartition("/")
        try:
            base = self.path(head) if head else self._objects  # no `..` leaves the root
        except InvalidArgument:
            return 0  # a folder no key can be under: nothing to delete
        deleted = 0
        for folder, _, files in os.walk(base, topdown=False):
            for name in files:
                path = Path(folder, name)
                if path.relative_to(self._objects).as_posix().startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                        deleted += 1
            self._prune(Path(folder))
        return deleted

    # --- multipart uploads ---------------------------------------------------------------------
    def create_upload(self, key: str) -> str:
        self.path(key)  # refuse a bad key now, not at completion
        upload_id = secrets.token_hex(16)
        try:
            staging = Path(tempfile.mkdtemp(dir=self._tmp, prefix="upload-"))
        except FileNotFoundError as err:
            raise _not_found(key, "writing", "bucket") from err
        (staging / "key").write_text(key, encoding="utf-8")
        staging.rename(self._uploads / upload_id)  # appears whole, key included
        return upload_id

    def has_upload(self, key: str, upload_id: str) -> bool:
        """Whether `upload_id` is an unfinished multipart upload of `key`."""
        if not _UPLOAD_ID.match(upload_id):
            return False
        try:
            return (self._uploads / upload_id / "key").read_text(encoding="utf-8") == key
        except (FileNotFoundError, NotADirectoryError):
            return False

    def write_part(self, key: str, upload_id: str, number: int, chunks: Iterable[Bytes]) -> str:
        """Store part `number` of an upload; returns its ETag (its MD5, quoted, as S3's)."""
        if not self.has_upload(key, upload_id):
            raise _no_upload(key, "writing")
        digest = hashlib.md5(usedforsecurity=False)
        with self._staged(key, "writing") as (file, temp):
            for chunk in chunks:
                digest.update(chunk)
                file.write(chunk)
            try:
                temp.rename(self._uploads / upload_id / f"{number}.{digest.hexdigest()}")
            except FileNotFoundError as err:  # aborted meanwhile
                raise _no_upload(key, "writing") from err
        return f'"{digest.hexdigest()}"'

    def complete_upload(self, key: str, upload_id: str, etags: Sequence[str],
                        *, write_once: bool = False) -> None:
        """Join the parts named by `etags` (part i+1 first) into the object, then drop the
        upload. S3's refusals: InvalidArgument for an unknown upload (NoSuchUpload), a part not
        uploaded with that ETag (InvalidPart) or one under 5 MiB but the last (EntityTooSmall);
        AlreadyExists with `write_once` when `key` holds an object."""
        action = "completing"
        if not self.has_upload(key, upload_id):
            raise _no_upload(key, action)
        upload = self._uploads / upload_id
        parts = [upload / f"{n}.{_md5_of(etag)}" for n, etag in enumerate(etags, start=1)]
        try:
            sizes = [part.stat().st_size for part in parts]
        except FileNotFoundError as err:
            raise InvalidArgument(f"{action} blob {key}: InvalidPart: a part was not uploaded "
                                  "with the ETag given for it", field=key) from err
        small = next((n for n, size in enumerate(sizes[:-1], start=1) if size < MIN_PART), None)
        if small is not None:
            raise InvalidArgument(f"{action} blob {key}: EntityTooSmall: part {small} is under "
                                  "5 MiB and not the last", field=key)
        dest = self.path(key)
        with self._staged(key, action) as (file, temp):
            for part in parts:
                try:
                    with open(part, "rb") as source:
                        shutil.copyfileobj(source, file, CHUNK)
                except FileNotFoundError as err:  # completed or aborted meanwhile
                    raise _no_upload(key, action) from err
            self._commit(temp, dest, key, action, write_once)
        shutil.rmtree(upload, ignore_errors=True)

    def abort_upload(self, key: str, upload_id: str) -> None:
        if self.has_upload(key, upload_id):
            shutil.rmtree(self._uploads / upload_id, ignore_errors=True)

    # --- internals -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _staged(self, key: str, action: str) -> Iterator[tuple[BinaryIO, Path]]:
        """A new temporary file, removed on the way out unless it was moved into place."""
        try:
            fd, name = tempfile.mkstemp(dir=self._tmp, prefix="part-")
        except FileNotFoundError as err:
            raise _not_found(key, action, "bucket") from err
        temp = Path(name)
        try:
            with open(fd, "wb") as file:  # buffered: it loops over short writes
                yield file, temp
        except OSError as err:
            raise _disk_failed(key, action, err) from err
        finally:
            temp.unlink(missing_ok=True)

    def _commit(self, temp: Path, dest: Path, key: str, action: str, write_once: bool) -> None:
        """Move `temp` to `dest`: a rename, or with `write_once` a link, which fails where
        `dest` exists (an atomic create-if-absent)."""
        for _ in range(_ATTEMPTS):
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                if write_once:
                    os.link(temp, dest)
                else:
                    os.replace(temp, dest)
                return
            except FileNotFoundError:  # a delete pruned the folder just made: make it again
                continue
            except (FileExistsError, NotADirectoryError, IsADirectoryError) as err:
                if write_once and dest.is_file():
                    raise AlreadyExists(f"{action} blob {key}: the object exists already (a "
                                        "write-once write)", field=key) from err
                if dest.is_dir() and not any(dest.iterdir()):
                    self._prune(dest)  # an empty folder left by a delete: not an object
                    continue
                raise InvalidArgument(
                    f"{action} blob {key}: a local folder cannot hold an object both at a key "
                    "and under it (another object's key is a folder of this one, or the "
                    "reverse)", field=key) from err
        raise FedhiveError(f"{action} blob {key}: its folder kept being deleted", field=key)

    def _prune(self, folder: Path) -> None:
        """Remove `folder` and its parents up to `objects/` while they are empty."""
        while folder != self._objects and self._objects in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone): the folders above are not empty either
                return
            folder = folder.parent


def _md5_of(etag: str) -> str:
    found = _ETAG.match(etag.strip().lower())
    return found.group(1) if found else "invalid"


def _not_found(key: str, action: str, what: str = "object") -> BlobNotFound:
    return BlobNotFound(f"{what} not found {action} blob {key}", field=key)


def _disk_failed(key: str, action: str, err: OSError) -> FedhiveError:
    return FedhiveError(f"{action} blob {key}: {err.strerror or err}", field=key)


def _no_upload(key: str, action: str) -> InvalidArgument:
    return InvalidArgument(f"{action} blob {key}: no such multipart upload", field=key)
