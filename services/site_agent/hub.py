"""A hub site (seed 004): a site of this (upper) tier whose "training" is a whole lower-tier
fedhive system, reached through that system's gateway.

A site is a hub when its folder has `local/hub.json`:

    {
      "gateway": "t2-gateway.example.org:50051",  required: the lower tier's gateway
      "token_file": "t2-token",                    required: a file (relative to local/) holding
                                                   an admin token of the lower tier (a lead or
                                                   project_admin: it submits and manages jobs)
      "root_certificates": "t2-ca.pem",            optional: TLS to the gateway with this CA
      "sites": ["t2-a", "t2-b"],                   optional: the lower tier's sites a job may
                                                   use (default: those online at deploy)
      "min_clients": 2,                            optional: the lower-tier job's min_clients
      "resource_spec": {"t2-a": {"num_of_gpus": 1}},  optional: its resource_spec
      "project": "BC",                             optional: the lower tier's project name, for
                                                   `BC.<task>` operator entries
      "task_read_wait_time": 10,                   optional, 10: how long the lower tier may take
                                                   to pick a task up (then the task fails and
                                                   the lower-tier job is aborted)
      "task_wait_time": null,                      optional: how long a task may take there
                                                   (null: as long as the lower-tier job runs)
      "controller_wait_time": null                 optional: how long the lower-tier job waits
                                                   for the next task before failing
    }

What the hub does for this tier's job runner (`SiteAgent` calls it):
* check_resources: the lower tier must answer and have its sites online (the named ones, or
  at least `min_clients`, or one);
* deploy: the deployed app (this tier's site app, custom code included) becomes the site app of
  a lower-tier operation-driven job with the SAME job id, whose server runs the
  `OperationController` with the `operators` of this tier's server config (the runner ships them
  in the bundle, `fedhive.jobs.tiers.OPERATORS_FILE`) — submitted through the lower tier's
  gateway; submitting again (a redelivered deploy, a restarted agent) finds the same job;
* start: the client job runs `HubExecutor` for every task instead of the app's executors;
* abort: the lower-tier job is aborted too, with this tier's reason;
* heartbeats stop while the lower tier's gateway does not answer, so this tier's runner sees
  the hub offline and its scheduler does not count on it.

Every problem with the file, the gateway, the token or a named site stops the agent at start
with one line naming it, never at round 5.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import structlog

from fedhive.errors import ConfigError, FailedPrecondition, FedhiveError, InvalidArgument, NotFound
from fedhive.jobs.tiers import OPERATORS_FILE, hierarchy_meta
from fedhive.resources import CheckResult
from fedhive.sdk import Session
from fedhive.sdk.operations import operation_job

from .hub_config import HubConfig

log = structlog.get_logger()

PROBE_TIMEOUT_S = 5.0


class Hub:
    """The agent's side of a hub site (see the module doc)."""

    def __init__(self, config: HubConfig, site: str) -> None:
        self.config = config
        self.site = site
        self._session = config.session(timeout=30.0)
        self._probe = config.session(timeout=PROBE_TIMEOUT_S)
        self._log = log.bind(site=site, hub=config.gateway)

    def close(self) -> None:
        self._session.close()
        self._probe.close()

    def verify(self) -> None:
        """At start: the gateway answers, the token is taken, every named site exists."""
        try:
            known = {info.name for info in self._probe.sites()}
        except FedhiveError as err:
            raise ConfigError(f"{self.config.path}: the lower tier's gateway "
                              f"{self.config.gateway}: {err.message}", field="gateway") from None
        missing = sorted(set(self.config.sites) - known)
        if missing:
            raise ConfigError(f"{self.config.path}: field 'sites': the lower tier has no site "
                              f"{missing[0]!r} (it has: {', '.join(sorted(known)) or 'none'})",
                              field="sites")

    def unreachable(self) -> str:
        """Why the lower tier cannot take work now ("" when it can)."""
        try:
            self._probe.sites()
        except FedhiveError as err:
            return f"the lower tier's gateway {self.config.gateway}: {err.message}"
        return ""

    def check(self) -> CheckResult:
        try:
            sites = self._probe.sites()
        except FedhiveError as err:
            return CheckResult(False, reason=f"the lower tier does not answer: {err.message}")
        online = {info.name for info in sites if info.online}
        wanted = set(self.config.sites) or {info.name for info in sites}
        needed = self.config.min_clients or (len(self.config.sites) or 1)
        if len(online & wanted) < needed:
            return CheckResult(False, reason=f"the lower tier has {len(online & wanted)} of its "
                               f"sites online, the job needs {needed}")
        return CheckResult(True)

    def deploy(self, job_id: str, app_dir: Path) -> None:
        """Submit the lower-tier job for `job_id` (same id; found again when it exists)."""
        shipped = json.loads((app_dir / OPERATORS_FILE).read_text()) \
            if (app_dir / OPERATORS_FILE).is_file() else {}
        sites = list(self.config.sites) or [s.name for s in self._session.sites() if s.online]
        archive = operation_job(
            app_dir, name=str(shipped.get("name", job_id)), sites=sites,
            operators=shipped.get("operators"), components=shipped.get("components"),
            min_clients=self.config.min_clients, resource_spec=self.config.resource_spec,
            project=self.config.project, task_wait_time=self.config.controller_wait_time,
            extra_meta=hierarchy_meta(int(shipped.get("tier", 1)) + 1, job_id, self.site))
        try:
            result = self._session.submit(archive, job_id=job_id, submission_id=job_id)
        except FedhiveError as err:
            kind = InvalidArgument if isinstance(err, InvalidArgument) else FailedPrecondition
            raise kind(f"the lower tier ({self.config.gateway}) refused job {job_id}: "
                       f"{err.message}", field=err.field) from None
        self._log.info("hub.submitted", job_id=job_id, existed=result.existed)

    def abort(self, job_id: str, reason: str) -> None:
        """Abort the lower-tier job (best effort: logged when it cannot be)."""
        abort_lower(self._session, job_id, f"the upper tier aborted it: {reason}", self._log)


def abort_lower(session: Session, job_id: str, reason: str, log: Any) -> None:
    """Abort the lower tier's job `job_id` unless it has ended (or never was); a failure is
    logged, not raised: the caller is cleaning up (the agent's abort, the hub client job's)."""
    try:
        if session.get(job_id).status.is_final:
            return
        session.abort(job_id, reason[:1000])
        log.info("hub.aborted", job_id=job_id, reason=reason[:200])
    except NotFound:
        return
    except FedhiveError as err:
        log.warning("hub.abort_failed", job_id=job_id, error=err.message)
