"""Archive attacks are refused before anything is written; extraction is all or nothing."""

from __future__ import annotations

import io
import os
import stat
import struct
import warnings
import zipfile
from pathlib import Path

import pytest

from fedhive.errors import InvalidArgument
from fedhive.jobs.archive import ArchiveLimits, UnsafeArchive, extract_archive, write_zip
from fedhive.jobs.definition import load_job

MiB = 1024 * 1024


def make_zip(*members: tuple[str | zipfile.ZipInfo, bytes]) -> bytes:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns on the duplicate names we build on purpose
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, content in members:
                archive.writestr(name, content)
    return buffer.getvalue()


def unix_member(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name)
    info.create_system = 3
    info.external_attr = mode << 16
    return info


def lie_about_size(data: bytes, declared: int) -> bytes:
    """Rewrite the (single) member's uncompressed size in both its headers."""
    raw = bytearray(data)
    local = raw.find(b"PK\x03\x04")
    central = raw.find(b"PK\x01\x02")
    struct.pack_into("<I", raw, local + 22, declared)
    struct.pack_into("<I", raw, central + 24, declared)
    return bytes(raw)


OK = ("job/meta.json", b"{}")
ATTACKS = {
    "zip_slip": (make_zip(OK, ("../evil.sh", b"x")), "'../evil.sh': '..' in path"),
    "nested_slip": (make_zip(("job/../../x", b"x")), "'..' in path"),
    "absolute_path": (make_zip(OK, ("/etc/cron.d/x", b"x")), "absolute path"),
    "drive_letter": (make_zip(("C:/x", b"x")), "absolute path"),
    "backslash": (make_zip(("..\\..\\x", b"x")), "backslash in name"),
    "symlink": (
        make_zip(OK, (unix_member("job/link", stat.S_IFLNK | 0o777), b"/etc/passwd")),
        "'job/link': symbolic link",
    ),
    "fifo": (make_zip((unix_member("job/p", stat.S_IFIFO | 0o644), b"")), "special file"),
    "duplicate_name": (make_zip(OK, ("job/a", b"1"), ("job/a", b"2")), "'job/a': duplicate name"),
    "file_and_folder": (make_zip(("job/a", b"1"), ("job/a/b", b"2")), "used both as a file"),
    "high_ratio": (make_zip(OK, ("job/zeros", bytes(20 * MiB))), "compression ratio"),
    "huge_declared_size": (
        lie_about_size(make_zip(("job/big", b"x" * 1000)), 2**32 - 1),
        "more than the limit of",
    ),
    "not_a_zip": (b"PK not really a zip", "not a readable zip archive"),
}


@pytest.mark.parametrize(("data", "expected"), ATTACKS.values(), ids=ATTACKS.keys())
def test_attacks_are_refused_before_writing(tmp_path: Path, data: bytes, expected: str) -> None:
    dest = tmp_path / "out" / "app"
    with pytest.raises(UnsafeArchive) as caught:
        extract_archive(data, dest, ArchiveLimits())
    assert any(expected in line for line in caught.value.violations), caught.value.violations
    assert isinstance(caught.value, InvalidArgument)
    assert list(tmp_path.iterdir()) == []  # not even the parent folder was created
    with pytest.raises(UnsafeArchive):
        load_job(data)


def test_oversize_archive_and_too_many_files(tmp_path: Path) -> None:
    data = make_zip(*[(f"job/f{i}", os.urandom(300)) for i in range(6)])
    path = tmp_path / "job.zip"
    path.write_bytes(data)
    with pytest.raises(UnsafeArchive, match=r"more than the limit of 1000$"):
        extract_archive(path, tmp_path / "a", ArchiveLimits(max_archive_bytes=1000))
    with pytest.raises(UnsafeArchive, match="archive has 6 files, more than the limit of 5"):
        extract_archive(data, tmp_path / "b", ArchiveLimits(max_files=5))
    with pytest.raises(UnsafeArchive, match="unpacks to 1800 bytes"):
        load_job(data, ArchiveLimits(max_uncompressed_bytes=1000))
    assert sorted(os.listdir(tmp_path)) == ["job.zip"]


def test_overall_ratio_catches_many_small_bombs(tmp_path: Path) -> None:
    data = make_zip(*[(f"job/z{i}", bytes(512 * 1024)) for i in range(8)])  # each below floor
    with pytest.raises(UnsafeArchive, match="archive compression ratio"):
        extract_archive(data, tmp_path / "a", ArchiveLimits())


def test_every_problem_is_listed(tmp_path: Path) -> None:
    data = make_zip(("../a", b""), ("/b", b""), ("ok/c", b""), ("ok/c", b""))
    with pytest.raises(UnsafeArchive) as caught:
        extract_archive(data, tmp_path / "x", ArchiveLimits())
    assert len(caught.value.violations) == 3
    assert str(caught.value) == "; ".join(caught.value.violations)


def test_member_larger_than_declared_leaves_nothing(tmp_path: Path) -> None:
    data = lie_about_size(make_zip(("job/big", os.urandom(5000))), 10)
    dest = tmp_path / "app"
    with pytest.raises(UnsafeArchive, match="could not be unpacked"):
        extract_archive(data, dest, ArchiveLimits())
    assert list(tmp_path.iterdir()) == []


def test_extracts_a_safe_archive(tmp_path: Path) -> None:
    data = make_zip(("app/config/c.json", b"{}"), ("app/custom/", b""), ("app/run.py", b"pass"))
    dest = tmp_path / "bundle"
    names = extract_archive(data, dest, ArchiveLimits())
    assert names == ["app/config/c.json", "app/run.py"]
    assert (dest / "app" / "run.py").read_bytes() == b"pass"
    assert (dest / "app" / "custom").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["bundle"]
    with pytest.raises(InvalidArgument, match="already exists"):
        extract_archive(data, dest, ArchiveLimits())


def test_write_zip_is_normalised_and_checks_names() -> None:
    first = write_zip([("b", lambda: b"2"), ("a/x", lambda: b"1")])
    second = write_zip([("a/x", lambda: b"1"), ("b", lambda: b"2")])
    assert first is not None and first == second
    with zipfile.ZipFile(io.BytesIO(first)) as archive:
        assert archive.namelist() == ["a/x", "b"]
        assert {info.external_attr >> 16 for info in archive.infolist()} == {stat.S_IFREG | 0o644}
    with pytest.raises(InvalidArgument, match=r"'\.\.' in path"):
        write_zip([("../x", lambda: b"")])


def test_corrupt_member_is_an_unsafe_archive_not_a_crash(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("meta.json", b'{"name": "corrupt-me"}')
    data = buffer.getvalue().replace(b"corrupt-me", b"CORRUPT-ME")  # CRC no longer matches
    with pytest.raises(UnsafeArchive, match=r"member 'meta\.json' could not be read"):
        load_job(data)
    with pytest.raises(UnsafeArchive, match="could not be unpacked"):
        extract_archive(data, tmp_path / "x", ArchiveLimits())
    assert list(tmp_path.iterdir()) == []
