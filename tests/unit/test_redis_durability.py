"""Every Redis fedhive starts, or ships a file to start, is durable: the command line of
`fedhive poc start` (libs/fedhive/poc/infra.py), the same in deploy/local/ensure-infra.sh, and
docker-compose.yml's. tests/integration/test_redis_durability.py kills and restarts one."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from fedhive.config import Settings
from fedhive.errors import PocFailed
from fedhive.poc import infra

ROOT = Path(__file__).resolve().parents[2]
AOF = ["--appendonly", "yes", "--appendfsync", "everysec"]


def test_fedhive_starts_redis_with_an_append_only_file_in_its_data_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "redis"
    assert infra.redis_argv(6390, data) == [
        "redis-server", "--daemonize", "yes", "--bind", "127.0.0.1", "--port", "6390",
        "--dir", str(data), *AOF, "--save", "",
        "--logfile", f"{data}/redis.log", "--pidfile", f"{data}/redis.pid"]
    monkeypatch.setenv("HOME", str(tmp_path))
    assert infra.redis_dir(6390) == tmp_path / ".fedhive" / "redis" / "6390"


def test_ensure_infra_sh_starts_the_same_redis() -> None:
    """make test and CI start Redis with the script: on 6379, in ~/.fedhive/redis/6379."""
    script = (ROOT / "deploy" / "local" / "ensure-infra.sh").read_text()
    assert '\nredis_dir="$HOME/.fedhive/redis/6379"\n' in script
    start = script.index("  redis-server ")
    command = script[start:script.index("\n", script.index("--pidfile", start))]
    assert shlex.split(command.replace("\\\n", " ")) == infra.redis_argv(6379, Path("$redis_dir"))


def test_the_compose_redis_keeps_an_append_only_file_on_its_volume() -> None:
    redis = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]
    assert redis["command"][:5] == ["redis-server", *AOF]
    assert redis["volumes"] == ["redis-data:/data"]  # the image's working directory


def test_a_redis_data_folder_that_cannot_be_made_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".fedhive").write_text("a file where the folder belongs")
    redis = next(s for s in infra.services(Settings()) if s.key == "redis")
    with pytest.raises(PocFailed) as err:
        infra._redis_data(redis)
    assert str(err.value) == (
        f"cannot make Redis's data folder {tmp_path}/.fedhive/redis/6379 (Not a directory): "
        "make it writable by this user, or start Redis yourself, e.g. `redis-server "
        "--daemonize yes --appendonly yes --appendfsync everysec`")
