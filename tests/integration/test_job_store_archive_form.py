"""The normalised archive the job-store stores: incompressible members (model weights,
binaries) are stored as is, everything else deflated; the bytes stay a function of the content."""

from __future__ import annotations

import io
import os
import zipfile

from fedhive.jobs.definition import load_job
from tests.fixtures.job_store import job_zip

KiB = 1024


def test_incompressible_members_are_stored_and_the_rest_deflated() -> None:
    weights = os.urandom(256 * KiB)
    upload = job_zip("form", files={"srv/custom/weights.bin": weights,
                                    "srv/custom/notes.txt": b"abc " * 64 * KiB})
    archive = load_job(upload).to_zip()
    assert archive is not None
    with zipfile.ZipFile(io.BytesIO(archive)) as stored:
        kinds = {info.filename: info.compress_type for info in stored.infolist()}
        assert stored.read("srv/custom/weights.bin") == weights
    assert kinds["srv/custom/weights.bin"] == zipfile.ZIP_STORED
    assert kinds["srv/custom/notes.txt"] == zipfile.ZIP_DEFLATED
    assert kinds["meta.json"] == zipfile.ZIP_DEFLATED  # small members are always deflated


def test_normalising_again_gives_the_same_bytes() -> None:
    upload = job_zip("form", files={"srv/custom/weights.bin": os.urandom(128 * KiB)})
    once = load_job(upload).to_zip()
    assert once is not None
    assert load_job(once).to_zip() == once
