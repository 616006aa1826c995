"""What can never run, decided at submit time from the sites' last reports (pure).

A job is refused when a mandatory client has never registered, or when its resource_spec asks
a registered site for more of a resource than that site's total (the `total` part of the
resource report in its last heartbeat, e.g. `{"total": {"gpu": 1}, "free": {...}}`). Sites
that never registered, and resources a site does not report as a number, are not judged: they
may still come or change.
"""

from __future__ import annotations

from collections.abc import Mapping

from fedhive.jobs.record import JobMeta
from fedhive.sites.heartbeat import SiteHeartbeat


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def never_runnable(meta: JobMeta, last: Mapping[str, SiteHeartbeat]) -> list[str]:
    """One line per problem, naming the site and resource; empty when the job may run."""
    problems = [f"mandatory site {site!r} has never registered"
                for site in meta.mandatory_clients if site not in last]
    for site, spec in sorted(meta.resource_spec.items()):
        beat = last.get(site)
        totals = beat.resources.get("total") if beat is not None else None
        if not isinstance(totals, dict):
            continue
        for resource, wanted in sorted(spec.items()):
            need, have = _number(wanted), _number(totals.get(resource))
            if need is not None and have is not None and need > have:
                problems.append(f"site {site!r}: {resource} {wanted} > {totals[resource]} "
                                "in total on that site")
    return problems
