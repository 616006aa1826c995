"""A read-only view of a job's files, the same whether they come from a folder or a zip.

Validation and packaging only see `JobFiles`: relative POSIX names and a way to read them.
A folder is walked without following links and held to the same limits as an archive (a job
must fit in one), so both inputs are accepted or refused alike.
"""

from __future__ import annotations

import os
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from fedhive.jobs.archive import (
    CORRUPT_ZIP_ERRORS,
    ArchiveLimits,
    UnsafeArchive,
    member_name_problem,
    open_archive,
)
from fedhive.text import clip


class FileSource(Protocol):
    def read(self, name: str) -> bytes:
        """The content of the file stored under `name` (a name this source listed)."""
        ...

    def size(self, name: str) -> int:
        """Its size in bytes, known without reading it (a zip member's declared size, which
        reading never exceeds)."""
        ...


class _FolderSource:
    def __init__(self, root: Path) -> None:
        self.root = root

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def size(self, name: str) -> int:
        return (self.root / name).lstat().st_size


class _ZipSource:
    def __init__(self, archive: zipfile.ZipFile) -> None:
        self.archive = archive

    def read(self, name: str) -> bytes:
        try:
            return self.archive.read(name)
        except CORRUPT_ZIP_ERRORS as err:
            raise UnsafeArchive(
                [f"member {clip(name)} could not be read: {err}"], field="archive"
            ) from None

    def size(self, name: str) -> int:
        return self.archive.getinfo(name).file_size


@dataclass(frozen=True, eq=False)
class JobFiles:
    """Files keyed by their name in the job (`paths`: job name -> name in the source).

    Two views are equal when they list the same files and folders, wherever they come from.
    """

    source: FileSource = field(repr=False)
    paths: dict[str, str]
    dirs: frozenset[str]  # every folder, explicit or implied by a file

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, JobFiles):
            return NotImplemented
        return self.paths.keys() == other.paths.keys() and self.dirs == other.dirs

    def __hash__(self) -> int:
        return hash((frozenset(self.paths), self.dirs))

    def names(self) -> list[str]:
        return sorted(self.paths)

    def has_file(self, name: str) -> bool:
        return name in self.paths

    def has_dir(self, name: str) -> bool:
        return name in self.dirs

    def read(self, name: str) -> bytes:
        return self.source.read(self.paths[name])

    def size(self, name: str) -> int:
        return self.source.size(self.paths[name])

    def top_level(self) -> set[str]:
        """Names of the files and folders directly at the root."""
        return {name.split("/", 1)[0] for name in [*self.paths, *self.dirs]}

    def without(self, name: str) -> JobFiles:
        return JobFiles(self.source, {k: v for k, v in self.paths.items() if k != name}, self.dirs)

    def subtree(self, folder: str) -> JobFiles:
        """The files under `folder`, renamed relative to it."""
        prefix = folder + "/"
        return JobFiles(
            self.source,
            {k[len(prefix) :]: v for k, v in self.paths.items() if k.startswith(prefix)},
            frozenset(d[len(prefix) :] for d in self.dirs if d.startswith(prefix)),
        )

    def nested(self, folder: str) -> JobFiles:
        """The same files moved one level down, under `folder`."""
        return JobFiles(
            self.source,
            {f"{folder}/{k}": v for k, v in self.paths.items()},
            frozenset({folder, *(f"{folder}/{d}" for d in self.dirs)}),
        )


def _with_parents(files: list[str], dirs: list[str]) -> frozenset[str]:
    found = set(dirs)
    for name in files:
        found.update(str(p) for p in PurePosixPath(name).parents if str(p) != ".")
    return frozenset(found)


def zip_files(source: bytes | Path, limits: ArchiveLimits) -> JobFiles:
    """The files of a zip archive, after every archive safety check."""
    archive, members = open_archive(source, limits)
    files = [m.name for m in members if not m.is_dir]
    return JobFiles(
        _ZipSource(archive),
        {name: name for name in files},
        _with_parents(files, [m.name for m in members if m.is_dir]),
    )


def folder_files(root: Path, limits: ArchiveLimits) -> JobFiles:
    """The files under `root`; links and special files are refused, sizes held to `limits`."""
    problems: list[str] = []
    files: list[str] = []
    dirs: list[str] = []
    total = 0
    for current, subdirs, names in os.walk(root, followlinks=False):
        for name in sorted([*subdirs, *names]):
            path = Path(current, name)
            rel = path.relative_to(root).as_posix()
            mode = path.lstat().st_mode
            problem = member_name_problem(rel, limits.max_name_length)
            if problem is None and stat.S_ISLNK(mode):
                problem = "symbolic link"
            elif problem is None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                problem = "special file (device, fifo or socket)"
            if problem is not None:
                problems.append(f"{clip(rel)}: {problem}")
            elif stat.S_ISDIR(mode):
                dirs.append(rel)
            else:
                files.append(rel)
                total += path.lstat().st_size
    if len(files) > limits.max_files:
        problems.append(f"job has {len(files)} files, more than the limit of {limits.max_files}")
    if total > limits.max_uncompressed_bytes:
        problems.append(
            f"job files total {total} bytes, more than the limit of {limits.max_uncompressed_bytes}"
        )
    if problems:
        raise UnsafeArchive(problems, field="archive")
    return JobFiles(_FolderSource(root), {name: name for name in files}, _with_parents(files, dirs))
