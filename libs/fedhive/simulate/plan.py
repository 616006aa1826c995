"""Which sites a simulation runs and which app each one gets: the deploy map applied to the
simulated sites, with the job's minimums checked before anything starts.

Sites are named `site-1` .. `site-N` for `-n N`, as FLARE's simulator names them, unless named
explicitly; a job whose deploy map names its sites runs on those when neither is given. Every
problem is an `InvalidArgument` of one line naming the option or the meta.json field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fedhive.errors import InvalidArgument
from fedhive.jobs.definition import JobDefinition
from fedhive.jobs.validation import SERVER, site_name_problem

SITE_PREFIX = "site-"


@dataclass(frozen=True)
class Plan:
    sites: list[str]
    apps: dict[str, str]  # site (or `server`) -> the app it runs

    @property
    def server_app(self) -> str:
        return self.apps[SERVER]


def plan(job: JobDefinition, *, num_sites: int | None = None,
         names: Sequence[str] = ()) -> Plan:
    """The sites to simulate `job` on and their apps."""
    sites = _sites(job, num_sites, list(names))
    apps = {SERVER: job.server_app}
    for site in sites:
        app = job.app_for(site)
        if app is None:
            raise InvalidArgument(
                f"site {site!r}: the job's deploy_map deploys no app to it (it names "
                f"{', '.join(job.sites)}); simulate those sites with --sites",
                field="deploy_map")
        apps[site] = app
    meta = job.meta
    if meta.min_clients is not None and len(sites) < meta.min_clients:
        raise InvalidArgument(
            f"min_clients is {meta.min_clients} but {len(sites)} site(s) are simulated: "
            f"run at least {meta.min_clients} (-n {meta.min_clients})", field="min_clients")
    missing = [site for site in meta.mandatory_clients if site not in sites]
    if missing:
        raise InvalidArgument(
            f"mandatory_clients {', '.join(missing)} not among the simulated sites "
            f"({_listed(sites)}): name them with --sites", field="mandatory_clients")
    return Plan(sites, apps)


def _sites(job: JobDefinition, num_sites: int | None, names: list[str]) -> list[str]:
    if names:
        if num_sites is not None and num_sites != len(names):
            raise InvalidArgument(f"-n {num_sites} but {len(names)} site names given",
                                  field="num_sites")
        for name in names:
            if (problem := site_name_problem(name)) is not None:
                raise InvalidArgument(f"--sites: {problem}", field="sites")
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise InvalidArgument(f"--sites: {', '.join(duplicates)} named twice",
                                  field="sites")
        return names
    if num_sites is not None:
        if num_sites < 1:
            raise InvalidArgument(f"-n must be at least 1, got {num_sites}", field="num_sites")
        return [f"{SITE_PREFIX}{index}" for index in range(1, num_sites + 1)]
    if job.deploys_to_all or not job.sites:
        raise InvalidArgument(
            f"job {job.meta.name!r} deploys to @ALL: give the number of sites (-n N) or "
            "their names (--sites a,b)", field="num_sites")
    return job.sites


def _listed(sites: list[str]) -> str:
    return ", ".join(sites) if len(sites) <= 5 else f"{', '.join(sites[:5])}, ..."
