"""The POC's pieces that need no infrastructure: state file, files it writes, command lines and
environments, process handling, checks (tests/e2e/test_poc.py runs the whole thing)."""

from __future__ import annotations

import errno
import json
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedhive.auth import hash_token
from fedhive.config import Settings
from fedhive.errors import InvalidArgument, PocFailed
from fedhive.poc import checks, infra, procs
from fedhive.poc.demo import find_examples
from fedhive.poc.layout import MARKER, PocLayout
from fedhive.poc.s3server import free_ports
from fedhive.poc.services import admin_token, commands, environment
from fedhive.poc.start import PocOptions, _ended
from fedhive.poc.state import PocState, ProcessEntry, load_state
from fedhive.poc.stop import _tiers

SETTINGS = Settings(amqp_url="amqp://u:secret@127.0.0.1:5672/%2F",
                    s3_endpoint_url="http://127.0.0.1:9000", aws_access_key_id="k",
                    aws_secret_access_key="s", namespace="poc")


def entry(name: str, pid: int = 1, create_time: float = 1.0) -> ProcessEntry:
    return ProcessEntry(name, pid, create_time, f"/x/{name}.log", ["x"])


def test_the_state_file_round_trips_and_a_missing_one_is_none(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    assert load_state(path) is None
    state = PocState(str(tmp_path), "poc", ["site-1"], "127.0.0.1:50051", "http://s3", True,
                     "2026-01-01T00:00:00+00:00", [entry("gateway")], ["site-1"], ["redis"])
    state.save(path)
    assert load_state(path) == state
    assert path.stat().st_mode & 0o777 == 0o600
    path.write_text("{not json")
    with pytest.raises(PocFailed, match="cannot read"):
        load_state(path)
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(PocFailed, match="not a state file"):
        load_state(path)


def test_the_admin_token_survives_a_restart(tmp_path: Path) -> None:
    layout = PocLayout(tmp_path)
    token = admin_token(layout, "127.0.0.1:50051")
    assert admin_token(layout, "127.0.0.1:50052") == token
    assert 'gateway = "127.0.0.1:50052"' in layout.cli_config.read_text()
    admins = json.loads(layout.admins.read_text())["admins"]
    assert [a["token_sha256"] for a in admins] == [hash_token(token)]
    assert layout.cli_config.stat().st_mode & 0o777 == 0o600
    layout.admins.write_text(json.dumps({"admins": []}))  # the token no longer matches: new one
    assert admin_token(layout, "127.0.0.1:50051") != token


def test_site_names_come_from_the_prefix() -> None:
    assert PocOptions(sites=3, site_prefix="h-").site_names() == ["h-1", "h-2", "h-3"]
    with pytest.raises(InvalidArgument):
        PocOptions(site_prefix="bad.").site_names()
    with pytest.raises(InvalidArgument):
        PocOptions(sites=0).site_names()


def test_commands_and_stop_order(tmp_path: Path) -> None:
    layout = PocLayout(tmp_path)
    found = commands(layout, ["a-1", "a-2"], "127.0.0.1:1")
    assert [c.name for c in found] == ["job-store", "scheduler", "job-runner", "gateway",
                                       "site-a-1", "site-a-2"]
    assert found[4].argv[-2:] == ["--site-dir", str(layout.site_dir("a-1"))]
    entries = [entry("seaweedfs"), *(entry(c.name) for c in found)]
    assert [[e.name for e in tier] for tier in _tiers(entries)] == [
        ["scheduler", "job-runner"], ["job-store", "gateway", "site-a-1", "site-a-2"],
        ["seaweedfs"]]


def test_sites_get_no_service_credentials(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "from-the-user")
    layout = PocLayout(tmp_path)
    services = environment(SETTINGS, layout)
    assert services["FEDHIVE_AMQP_URL"] == SETTINGS.amqp_url
    assert services["AWS_SECRET_ACCESS_KEY"] == "s" and services[MARKER] == str(tmp_path)
    site = environment(SETTINGS, layout, site=True)
    assert site[MARKER] == str(tmp_path)
    assert not [k for k in site if k.startswith("AWS_") or k in (
        "FEDHIVE_AMQP_URL", "FEDHIVE_REDIS_URL", "FEDHIVE_S3_ENDPOINT_URL")]


def test_processes_by_pid_and_create_time(tmp_path: Path) -> None:
    sleeper = procs.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                          env={MARKER: str(tmp_path)}, log=tmp_path / "s.log", cwd=tmp_path)
    try:
        assert procs.alive(sleeper)
        assert not procs.alive(ProcessEntry("other", sleeper.pid, sleeper.create_time - 5,
                                            "", []))  # same pid, another process
        deadline = time.monotonic() + 10
        while sleeper.pid not in [p.pid for p in procs.marked(tmp_path)]:
            assert time.monotonic() < deadline, "the marked process is not found"
            time.sleep(0.05)
    finally:
        assert procs.stop_groups([sleeper], grace=5) == []
    assert not procs.alive(sleeper)
    assert procs.exit_code(sleeper) == -15  # SIGTERM
    assert procs.marked(tmp_path) == []


def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PocFailed) as err:
            checks.port_free("127.0.0.1", port, "gateway", "--port")
    assert str(err.value) == (f"port {port} (gateway) is already in use: stop the program "
                              "listening there, or pass --port with a free port")


def test_examples_are_found_or_named(tmp_path: Path) -> None:
    repo_examples = Path(__file__).resolve().parents[2] / "examples"
    assert find_examples(repo_examples) == repo_examples
    with pytest.raises(PocFailed, match="hello-numpy and hello-pt are not in"):
        find_examples(tmp_path)


def test_a_full_disk_is_one_line_naming_it(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What tests/e2e/test_poc_bad_input.py does with a small tmpfs, where it may not mount."""
    free = {"mib": 100}
    monkeypatch.setattr(checks.shutil, "disk_usage",
                        lambda _: SimpleNamespace(free=free["mib"] << 20))

    def full(how: str, root: Path = tmp_path) -> str:
        return (f"disk full: {how} on the disk of {root}, a POC needs 512 MiB: free some "
                "space, or pass --dir on another disk")

    with pytest.raises(PocFailed) as err:
        checks.disk_space(tmp_path / "poc")  # not there yet: the disk of its parent
    assert str(err.value) == full("100 MiB free", tmp_path / "poc")
    # after a failed start: a write that found no space, or a disk now full, is the cause
    with pytest.raises(PocFailed) as err:
        checks.blame_the_disk(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    assert str(err.value) == full("no space left")
    checks.blame_the_disk(tmp_path, PocFailed("gateway ended at start"))  # 100 MiB: not it
    free["mib"] = 3
    with pytest.raises(PocFailed) as err:
        checks.blame_the_disk(tmp_path, PocFailed("gateway ended at start"))
    assert str(err.value) == full("3 MiB free")


def test_a_port_taken_from_the_s3_server_while_it_started(tmp_path: Path) -> None:
    """Its ports are picked free just before it starts: another program may be faster."""
    state = PocState(str(tmp_path), "poc", ["site-1"], "127.0.0.1:1", "", True, "")
    log = tmp_path / "seaweedfs.log"
    log.write_text("E1123 mini.go:1244 Port allocation failed\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        weed = ProcessEntry("seaweedfs", 1, 1.0, str(log), ["weed", "mini", f"-s3.port={port}"])
        assert _ended(state, weed) == (
            f"port {port} (-s3.port of the embedded S3 server) was taken while it started: run "
            "the command again (it picks other free ports)")
    assert _ended(state, weed) == (f"seaweedfs ended at start: E1123 mini.go:1244 Port "
                                   f"allocation failed; see {log}")


def test_an_s3_server_that_does_not_answer_is_named() -> None:
    url = f"http://127.0.0.1:{free_ports(1)[0]}"
    with pytest.raises(PocFailed) as err:
        checks.s3_answers(url)
    assert str(err.value) == (f"S3 does not answer at {url} (FEDHIVE_S3_ENDPOINT_URL): start "
                              "it, or unset FEDHIVE_S3_ENDPOINT_URL to use the embedded SeaweedFS")


def test_a_command_of_the_infrastructure_that_hangs_is_one_line() -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(30)"]
    with pytest.raises(PocFailed) as err:
        infra._run(argv, 1, "start it yourself")
    assert str(err.value) == f"`{' '.join(argv)}` did not finish within 1 s: start it yourself"


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """Outgoing connections take their local ports from the ephemeral range: a listening port
    picked there could be gone before its server binds it."""
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = free_ports(5)
    assert len(set(ports)) == 5 and all(port < floor for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
