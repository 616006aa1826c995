"""What a process loads before it does anything: every `fedhive` command and every script using
the SDK pays for its imports on each start (the CLI's job commands ran in ~0.8 s, most of it
numpy, boto3, redis and the FL runtime that only `simulate`, `poc start` and the operation API
use). Checked in a fresh interpreter, by module name, never by time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Loaded on first use only: the FL runtime and numpy (simulate, the operation API), S3 and Redis
# clients (poc start, simulate), the POC's launcher.
HEAVY = ("numpy", "boto3", "botocore", "redis", "fedhive.fl", "fedhive.blobs", "fedhive.simulate",
         "fedhive.poc.start", "fedhive.sdk.operations")


def loaded_by(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    return set(json.loads(done.stdout.splitlines()[-1]))


def loaded_by_command(*args: str) -> set[str]:
    """What `fedhive ARGS` loads (the command's own output goes before the list)."""
    return loaded_by(f"from fedhive.cli.main import main\nsys.argv = ['fedhive', *{args!r}]\n"
                     "try:\n    main()\nexcept SystemExit:\n    pass")


@pytest.mark.parametrize("statement", [
    "import fedhive.cli.main",  # what every `fedhive` command imports before it runs
    "from fedhive.sdk import Session",
])
def test_the_cli_and_the_sdk_start_without_the_heavy_parts(statement: str) -> None:
    assert loaded_by(statement) & set(HEAVY) == set()


def test_a_client_job_loads_no_admin_s3_redis_or_gpu_client() -> None:
    # One starts per job and site; it reads no GPU (its agent did), talks to the broker only.
    loaded = loaded_by("import fedhive_services.site_agent.client_job")
    assert loaded & {"pynvml", "boto3", "redis", "grpc", "typer"} == set()


def test_the_heavy_parts_load_when_a_command_needs_them() -> None:
    loaded = loaded_by("import fedhive.cli.main\nfrom fedhive.simulate import simulate")
    assert {"numpy", "fedhive.fl", "fedhive.simulate"} <= loaded


@pytest.mark.parametrize("args", [(), ("--help",), ("version",)])
def test_the_command_list_loads_no_command(args: tuple[str, ...]) -> None:
    loaded = loaded_by_command(*args)
    commands = {"fedhive.cli.jobs", "fedhive.cli.poc", "fedhive.cli.demo", "fedhive.cli.watch",
                "fedhive.cli.simulate", "fedhive.cli.validate", "fedhive.cli.metrics"}
    assert loaded & (commands | {"grpc", "pika", "psutil", "fedhive.sdk"}) == set()


def test_a_gateway_command_loads_neither_the_job_formats_nor_the_other_commands() -> None:
    loaded = loaded_by_command("jobs", "--help")
    assert "fedhive.cli.jobs" in loaded
    others = {"fedhive.cli.poc", "fedhive.cli.demo", "fedhive.cli.simulate"}
    assert loaded & (others | {"fedhive.jobs.definition", "yaml", "pika"}) == set()


def test_offline_commands_load_no_grpc() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "hello-numpy"
    for args in (("validate", str(example)), ("config",), ("admin-token", "a@b.org")):
        assert loaded_by_command(*args) & {"grpc", "fedhive.sdk"} == set(), args
