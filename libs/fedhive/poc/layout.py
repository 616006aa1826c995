"""Where a POC keeps its files, all under one folder (default `~/.fedhive/poc`).

    state.json        what `poc start` started (processes with pid and create time, broker
                      users, infrastructure it started), read by `poc status` and `poc stop`
    config            the CLI config of the POC admin (TOML: gateway, token; mode 0600)
    admins.json       the gateway's admins file (the POC admin's token hash)
    logs/NAME.log     one log per process (truncated at each start)
    sites/SITE/       each site's folder (local/site.json with its broker password, workspace/)
    runner/           the job-runner's work dir (server job workspaces)
    s3/               the embedded SeaweedFS: s3.json (its identity, mode 0600) and data/
    results/          what `fedhive demo` downloads (job results, curves)
    .lock             held while a start or stop runs, so two never overlap
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fedhive.errors import PocFailed

DEFAULT_DIR = Path("~/.fedhive/poc")
# Set in the environment of every process a POC starts (and so inherited by their children:
# server jobs, client jobs, trainers): `poc stop` finds strays by it.
MARKER = "FEDHIVE_POC_DIR"
ADMIN = ("admin@poc", "poc", "project_admin")  # name, org, role of the POC admin


@dataclass(frozen=True)
class PocLayout:
    root: Path

    @classmethod
    def at(cls, path: Path | None) -> PocLayout:
        return cls((path or DEFAULT_DIR).expanduser().resolve())

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def cli_config(self) -> Path:
        return self.root / "config"

    @property
    def admins(self) -> Path:
        return self.root / "admins.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def site_dir(self, site: str) -> Path:
        return self.root / "sites" / site

    @property
    def runner_dir(self) -> Path:
        return self.root / "runner"

    @property
    def s3_dir(self) -> Path:
        return self.root / "s3"

    @property
    def results(self) -> Path:
        return self.root / "results"

    def make(self) -> None:
        for folder in (self.root, self.logs, self.runner_dir, self.s3_dir / "data"):
            folder.mkdir(parents=True, exist_ok=True)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the POC folder's lock (another start or stop in progress: PocFailed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PocFailed(f"another `fedhive poc` command is working on {self.root}: wait "
                                "for it to finish") from None
            yield
        finally:
            os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600 (it holds a secret), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)
