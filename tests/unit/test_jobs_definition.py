"""Loading jobs: folder and zip give one definition, single apps are wrapped, zips normalise."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest

from fedhive.jobs.archive import UnsafeArchive
from fedhive.jobs.definition import InvalidJobDefinition, load_job
from tests.unit.test_jobs_validation import BASE_META, write_app, write_job, zip_folder


def test_folder_and_zip_inputs_give_the_same_definition(tmp_path: Path) -> None:
    root = write_job(tmp_path / "j1", BASE_META)
    (root / "cli" / "custom").mkdir()
    (root / "cli" / "custom" / "trainer.py").write_text("print('hi')\n")
    zip_path = tmp_path / "upload.zip"
    zip_path.write_bytes(zip_folder(root))
    from_folder = load_job(root)
    for source in (zip_folder(root), zip_folder(root, top="j1"), zip_path):
        assert load_job(source) == from_folder
    assert from_folder.files.names() == sorted(
        str(p.relative_to(root).as_posix())
        for p in root.rglob("*")
        if p.is_file() and p.name != "meta.json"
    )
    assert from_folder.byoc and from_folder.server_app == "srv"
    assert from_folder.sites == ["site-1", "site-2"] and not from_folder.deploys_to_all
    assert from_folder.app_for("site-2") == "cli" and from_folder.app_for("site-9") is None
    assert from_folder.configs["cli"].client is not None
    assert from_folder.configs["cli"].server is None


def test_normalised_zip_round_trips_and_is_deterministic(tmp_path: Path) -> None:
    job = load_job(write_job(tmp_path / "j1", {**BASE_META, "scope": "public"}))
    data = job.to_zip()
    assert data is not None and data == job.to_zip()
    again = load_job(data)
    assert again.meta == job.meta and again.files.names() == job.files.names()
    out = tmp_path / "out.zip"
    assert job.to_zip(out) is None and out.read_bytes() == data
    with zipfile.ZipFile(out) as archive:
        names = archive.namelist()
        assert names == sorted(names) and names[:2] == [
            "all/README",
            "all/config/config_fed_client.json",
        ]
        assert json.loads(archive.read("meta.json"))["scope"] == "public"
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_single_app_folder_is_wrapped_for_all_sites(tmp_path: Path) -> None:
    write_app(tmp_path / "hello-numpy", "both")
    job = load_job(tmp_path / "hello-numpy")
    assert job.meta.name == "hello-numpy"
    assert job.meta.deploy_map == {"hello-numpy": ["@ALL"]}
    assert job.meta.min_clients == 1 and job.deploys_to_all and job.sites == []
    assert "hello-numpy/config/config_fed_server.json" in job.files.names()
    assert job.app_for("any-site") == "hello-numpy" and job.server_app == "hello-numpy"
    # zipped with or without its folder, and re-loaded from the normalised zip: the same job
    assert load_job(zip_folder(tmp_path / "hello-numpy", top="hello-numpy")) == job
    zipped = load_job(zip_folder(tmp_path / "hello-numpy"))
    assert zipped.meta.deploy_map == {"job": ["@ALL"]}
    normalised = job.to_zip()
    assert normalised is not None and load_job(normalised) == job


def test_single_app_needs_both_configs(tmp_path: Path) -> None:
    write_app(tmp_path / "lonely", "client")
    with pytest.raises(InvalidJobDefinition, match=r"config_fed_server\.json: is missing"):
        load_job(tmp_path / "lonely")


def test_meta_without_name_takes_the_folder_name(tmp_path: Path) -> None:
    meta = {k: v for k, v in BASE_META.items() if k != "name"}
    assert load_job(write_job(tmp_path / "my-job", meta)).meta.name == "my-job"


def test_folder_with_symlink_or_fifo_is_refused(tmp_path: Path) -> None:
    root = write_job(tmp_path / "j1", BASE_META)
    (root / "cli" / "custom").mkdir()
    os.symlink("/etc/passwd", root / "cli" / "custom" / "passwd")
    os.mkfifo(root / "srv" / "pipe")
    with pytest.raises(UnsafeArchive) as caught:
        load_job(root)
    assert caught.value.violations == [
        "'cli/custom/passwd': symbolic link",
        "'srv/pipe': special file (device, fifo or socket)",
    ]
