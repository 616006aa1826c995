"""`fedhive validate`: exit codes and output, through a local typer app."""

from __future__ import annotations

from pathlib import Path

import typer
from typer.testing import CliRunner

from fedhive.cli.validate import validate
from tests.unit.test_jobs_validation import BASE_META, write_job, zip_folder

app = typer.Typer()
app.command()(validate)
runner = CliRunner()


def test_valid_job_prints_one_line_summary(tmp_path: Path) -> None:
    root = write_job(tmp_path / "j1", BASE_META)
    for target in (root, _as_zip(root, tmp_path / "j1.zip")):
        result = runner.invoke(app, [str(target)])
        assert result.exit_code == 0, result.output
        assert result.stdout == (
            "valid: job 'j1': apps srv -> server, cli -> site-1 site-2; sites site-1, site-2\n"
        )


def test_invalid_job_prints_each_violation_on_stderr(tmp_path: Path) -> None:
    meta = {**BASE_META, "min_clients": 0, "mandatory_clients": ["site-9"]}
    result = runner.invoke(app, [str(write_job(tmp_path / "j1", meta))])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "job 'j1': min_clients: must be positive, got 0",
        "job 'j1': mandatory_clients: site 'site-9' is not in the deploy_map",
    ]


def test_unsafe_archive_and_missing_path_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip")
    result = runner.invoke(app, [str(bad)])
    assert result.exit_code == 2 and "not a readable zip archive" in result.stderr
    result = runner.invoke(app, [str(tmp_path / "missing")])
    assert result.exit_code == 2 and "no such file or folder" in result.stderr


def _as_zip(root: Path, path: Path) -> Path:
    path.write_bytes(zip_folder(root, top=root.name))
    return path
