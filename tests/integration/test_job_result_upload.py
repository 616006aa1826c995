"""The job result, built and uploaded streaming (services/job_runner/finish.py): the normalised
zip of the server job's workspace, a large member never read whole, the upload in parts."""

from __future__ import annotations

import io
import tempfile
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedhive.blobs import BlobStore
from fedhive.errors import InvalidArgument
from fedhive.jobs.archive import write_folder_zip, write_zip

MiB = 1024 * 1024


def workspace(root: Path, big_mib: int) -> dict[str, bytes]:
    files = {
        "metrics.json": b'{"rounds": []}\n' * 100,
        "cross_site_val/cross_val_results.json": b"{}",
        "model.npz": np.random.default_rng(0).bytes(big_mib * MiB),  # incompressible
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def test_the_result_zip_is_write_zip_s_normal_form_built_in_chunks(tmp_path: Path) -> None:
    files = workspace(tmp_path / "ws", 8)
    with (tmp_path / "result.zip").open("w+b") as out:
        tracemalloc.start()
        try:
            write_folder_zip(tmp_path / "ws", out)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 3 * MiB  # the 8 MiB member went through in 1 MiB chunks
    streamed = io.BytesIO((tmp_path / "result.zip").read_bytes())
    whole = write_zip([(name, lambda data=data: data) for name, data in files.items()])
    assert whole is not None
    with zipfile.ZipFile(streamed) as ours, zipfile.ZipFile(io.BytesIO(whole)) as theirs:
        assert ours.namelist() == theirs.namelist() == sorted(files)
        for name in files:
            mine, reference = ours.getinfo(name), theirs.getinfo(name)
            assert (mine.date_time, mine.external_attr, mine.compress_type) == (
                reference.date_time, reference.external_attr, reference.compress_type)
            assert ours.read(name) == files[name]
    assert ours.getinfo("model.npz").compress_type == zipfile.ZIP_STORED
    again = io.BytesIO()
    write_folder_zip(tmp_path / "ws", again)
    assert again.getvalue() == streamed.getvalue()  # same content, same bytes


def test_a_workspace_file_with_a_name_no_archive_may_hold_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "a\\b").write_bytes(b"x")
    with pytest.raises(InvalidArgument, match="cannot archive"):
        write_folder_zip(tmp_path / "ws", io.BytesIO())


@pytest.mark.parametrize("big_mib", [1, 13])
def test_the_upload_never_holds_the_whole_zip(
        tmp_path: Path, blob_store: BlobStore, blob_prefix: str, big_mib: int) -> None:
    files = workspace(tmp_path / "ws", big_mib)
    key = f"{blob_prefix}result.zip"
    with tempfile.TemporaryFile(dir=tmp_path) as archive:
        write_folder_zip(tmp_path / "ws", archive)
        size = archive.tell()
        tracemalloc.start()
        try:
            blob_store.put_file(key, archive)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    if big_mib > 5:
        assert peak < size / 2, (peak, size)  # streamed from a memory map of the file
    assert blob_store.size(key) == size
    with zipfile.ZipFile(io.BytesIO(blob_store.get(key))) as stored:
        assert {name: stored.read(name) for name in stored.namelist()} == files
