"""Zip archives that are safe to store and unpack: job definitions and app bundles.

Everything is checked from the central directory before a byte is written: archive size,
declared total size and compression ratio (zip bombs), file count, member names (absolute,
`..`, backslashes, duplicates) and member types (symlinks, devices, fifos). Extraction then
writes into a temporary sibling folder and renames it into place only when every member is out,
so a rejected or failing archive leaves nothing behind. `write_zip` makes the normalised form
that fedhive stores: sorted members, fixed timestamps and permissions, incompressible members
stored rather than deflated, so the same content always gives the same bytes (and the same
content hash).
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from fedhive.errors import InvalidArgument
from fedhive.text import clip

MiB = 1024 * 1024
MAX_VIOLATIONS = 50  # lines one error lists; the rest are counted
_CHUNK = 1 * MiB
STORE_FROM = 16 * MiB  # write_folder_zip stores members at least this big uncompressed
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # zip's epoch: no timestamps leak into the content hash
_SAMPLE = 64 * 1024  # members at least this big are stored as is when a sample of this
_MIN_SAVING = 0.97  # size does not deflate below this fraction of it
_ZIP_UNIX = 3  # ZipInfo.create_system for archives made on Unix (mode bits in external_attr)
# What reading a member of a well-formed directory can still raise: bad CRC, truncated data.
CORRUPT_ZIP_ERRORS = (zipfile.BadZipFile, EOFError, zlib.error)


@dataclass(frozen=True)
class ArchiveLimits:
    """What an archive (or a job folder) may contain. Passed in by the caller's settings."""

    max_archive_bytes: int = 256 * MiB  # the compressed archive as uploaded
    max_uncompressed_bytes: int = 1024 * MiB  # sum of the members' declared sizes
    max_ratio: float = 100.0  # uncompressed / compressed, per member and overall
    ratio_floor_bytes: int = 1 * MiB  # smaller members (and archives) are not ratio-checked
    max_files: int = 10_000
    max_name_length: int = 512


# For archives fedhive wrote itself (the job-store's normalised copy of a checked upload): the
# sizes still hold, the compression ratio does not (re-deflating may compress far better than
# the upload did, e.g. a config of many zeros).
STORED = ArchiveLimits(max_ratio=float("inf"))


class Violations(InvalidArgument):
    """An input with one or more problems, all of them listed (up to MAX_VIOLATIONS).

    `violations` holds one line per problem; `str(err)` is those lines joined by "; " so the
    whole list survives transports that carry a single message. `field` is the first problem's.
    Past MAX_VIOLATIONS the last line counts the problems left out, so no input makes the
    message unbounded.
    """

    def __init__(self, violations: list[str], *, field: str | None = None) -> None:
        if len(violations) > MAX_VIOLATIONS:
            more = len(violations) - MAX_VIOLATIONS + 1
            violations = [*violations[:MAX_VIOLATIONS - 1], f"... and {more} more problems"]
        super().__init__("; ".join(violations), field=field)
        self.violations = list(violations)


class UnsafeArchive(Violations):
    """The archive breaks a safety limit or is not a readable zip."""


@dataclass(frozen=True)
class ArchiveMember:
    name: str  # normalised: no trailing slash
    size: int  # declared uncompressed size (0 for folders)
    is_dir: bool


def member_name_problem(name: str, max_length: int = 512) -> str | None:
    """Why `name` (a zip member or a relative path) may not be written under a folder, or None."""
    if not name or name in ("/", "."):
        return "empty name"
    if len(name) > max_length:
        return f"name longer than {max_length} characters"
    if any(ord(ch) < 32 or ch == "\x7f" for ch in name):
        return "control character in name"
    if "\\" in name:
        return "backslash in name"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "absolute path"
    parts = name.rstrip("/").split("/")
    if ".." in parts:
        return "'..' in path"
    if any(part in ("", ".") for part in parts):
        return "empty or '.' path component"
    return None


def _member_kind_problem(info: zipfile.ZipInfo) -> str | None:
    if info.flag_bits & 0x1:
        return "encrypted member"
    mode = info.external_attr >> 16
    if info.create_system != _ZIP_UNIX or stat.S_IFMT(mode) == 0:
        return None  # no Unix file type recorded: a plain file or folder
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "special file (device, fifo or socket)"


def inspect_zip(
    archive: zipfile.ZipFile, archive_bytes: int, limits: ArchiveLimits
) -> list[ArchiveMember]:
    """Check every member of an open zip against `limits`; raise `UnsafeArchive` listing all."""
    problems: list[str] = []
    members: list[ArchiveMember] = []
    seen: set[str] = set()
    infos = archive.infolist()
    files = [info for info in infos if not info.is_dir()]
    if len(files) > limits.max_files:
        problems.append(
            f"archive has {len(files)} files, more than the limit of {limits.max_files}"
        )
    total = 0
    for info in infos:
        problem = member_name_problem(info.filename, limits.max_name_length)
        problem = problem or _member_kind_problem(info)
        name = info.filename.rstrip("/")
        if problem is None and name in seen:
            problem = "duplicate name"
        if problem is None and not info.is_dir():
            total += info.file_size
            if (
                info.file_size > limits.ratio_floor_bytes
                and info.file_size > limits.max_ratio * max(info.compress_size, 1)
            ):
                problem = (
                    f"compression ratio {info.file_size / max(info.compress_size, 1):.0f} "
                    f"above the limit of {limits.max_ratio:.0f}"
                )
        if problem is not None:
            problems.append(f"member {clip(info.filename)}: {problem}")
            continue
        seen.add(name)
        members.append(ArchiveMember(name, 0 if info.is_dir() else info.file_size, info.is_dir()))
    problems += _file_folder_clashes(members)
    if total > limits.max_uncompressed_bytes:
        problems.append(
            f"archive unpacks to {total} bytes, more than the limit of "
            f"{limits.max_uncompressed_bytes}"
        )
    elif total > limits.ratio_floor_bytes and total > limits.max_ratio * max(archive_bytes, 1):
        problems.append(
            f"archive compression ratio {total / max(archive_bytes, 1):.0f} above the limit "
            f"of {limits.max_ratio:.0f}"
        )
    if problems:
        raise UnsafeArchive(problems, field="archive")
    return members


def _file_folder_clashes(members: list[ArchiveMember]) -> list[str]:
    """A name used both as a file and as a folder cannot be unpacked."""
    files = {m.name for m in members if not m.is_dir}
    clashes = set()
    for member in members:
        for parent in PurePosixPath(member.name).parents:
            if str(parent) in files:
                clashes.add(str(parent))
    return [f"member {clip(name)}: used both as a file and as a folder"
            for name in sorted(clashes)]


def open_archive(
    source: bytes | Path, limits: ArchiveLimits
) -> tuple[zipfile.ZipFile, list[ArchiveMember]]:
    """Open and fully check a zip given as bytes or a file path (read into memory once)."""
    size = len(source) if isinstance(source, bytes) else _file_size(source)
    if size > limits.max_archive_bytes:
        raise UnsafeArchive(
            [f"archive is {size} bytes, more than the limit of {limits.max_archive_bytes}"],
            field="archive",
        )
    data = source if isinstance(source, bytes) else source.read_bytes()
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise UnsafeArchive([f"not a readable zip archive: {err}"], field="archive") from None
    try:
        return archive, inspect_zip(archive, size, limits)
    except UnsafeArchive:
        archive.close()
        raise


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as err:
        raise UnsafeArchive(
            [f"cannot read archive {clip(str(path))}: {err.strerror}"], field="archive"
        ) from None


def extract_archive(source: bytes | Path, dest: Path, limits: ArchiveLimits) -> list[str]:
    """Unpack a checked zip to `dest` (which must not exist); all or nothing. Returns file names."""
    if dest.exists():
        raise InvalidArgument(f"extraction target {str(dest)!r} already exists", field="dest")
    archive, members = open_archive(source, limits)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with archive:
            for member in members:
                target = staging / member.name
                if member.is_dir:
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                _copy_member(archive, member, target)
        staging.rename(dest)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, zipfile.BadZipFile | EOFError | OSError):
            raise UnsafeArchive(
                [f"archive could not be unpacked: {err}"], field="archive"
            ) from None
        raise
    return [m.name for m in members if not m.is_dir]


def _copy_member(archive: zipfile.ZipFile, member: ArchiveMember, target: Path) -> None:
    """Stream one member out, never writing more than its declared size."""
    written = 0
    with archive.open(member.name) as src, target.open("wb") as dst:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > member.size:
                raise zipfile.BadZipFile(f"member {clip(member.name)} is larger than declared")
            dst.write(chunk)
    os.chmod(target, 0o644)


def write_zip(
    members: Iterable[tuple[str, Callable[[], bytes]]], out: BinaryIO | Path | None = None
) -> bytes | None:
    """Write `(name, read content)` pairs as a normalised zip; return the bytes when `out` is None.

    Members are sorted by name with fixed timestamps and permissions, so equal content gives
    equal bytes. Names are checked like an uploaded archive's. Contents are read one at a time.
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer if out is None else out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, read in sorted(members, key=lambda pair: pair[0]):
            problem = member_name_problem(name)
            if problem is not None:
                raise InvalidArgument(f"cannot archive {clip(name)}: {problem}", field="archive")
            info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
            info.create_system = _ZIP_UNIX
            info.external_attr = (stat.S_IFREG | 0o644) << 16
            data = read()
            stored = incompressible(data)
            info.compress_type = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return buffer.getvalue() if out is None else None


def write_folder_zip(folder: Path, out: BinaryIO) -> None:
    """The files under `folder` (a job's result) as a zip in `out`, in write_zip's normalised
    form (sorted names, fixed times and modes, incompressible members stored; members from
    `STORE_FROM` bytes too: model weights deflate by ~10% for seconds of CPU per GiB), each
    copied in chunks: a file is never read whole."""
    files = sorted((p.relative_to(folder).as_posix(), p) for p in folder.rglob("*")
                   if p.is_file())
    with zipfile.ZipFile(out, "w", allowZip64=True) as archive:
        for name, path in files:
            problem = member_name_problem(name)
            if problem is not None:
                raise InvalidArgument(f"cannot archive {clip(name)}: {problem}", field="archive")
            with path.open("rb") as source:
                sample = source.read(_SAMPLE)
                source.seek(0)
                info = zipfile.ZipInfo(name, date_time=_FIXED_TIME)
                info.create_system = _ZIP_UNIX
                info.external_attr = (stat.S_IFREG | 0o644) << 16
                size = os.fstat(source.fileno()).st_size
                stored = size >= STORE_FROM or incompressible(sample)
                info.compress_type = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
                info.file_size = size  # decides zip64
                with archive.open(info, "w") as member:
                    shutil.copyfileobj(source, member, _CHUNK)


def incompressible(data: bytes) -> bool:
    """Whether `data` is not worth deflating, judged from its first `_SAMPLE` bytes (a
    function of the content alone, so the normalised archive stays deterministic): model
    weights and other binaries save nothing and would cost the most CPU of a submit."""
    if len(data) < _SAMPLE:
        return False
    sample = memoryview(data)[:_SAMPLE]
    return len(zlib.compress(sample)) >= _SAMPLE * _MIN_SAVING
