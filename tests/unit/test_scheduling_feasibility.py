"""Submit-time refusal of jobs no registered site could ever run."""

from __future__ import annotations

from fedhive.jobs.record import JobMeta
from fedhive.scheduling.feasibility import never_runnable
from fedhive.sites.heartbeat import SiteHeartbeat

LAST = {
    "site-1": SiteHeartbeat("site-1", resources={"total": {"gpu": 1}, "free": {"gpu": 0}}),
    "site-2": SiteHeartbeat("site-2"),
}


def meta(**fields: object) -> JobMeta:
    return JobMeta("j", deploy_map={"app": ["server", "site-1", "site-2"]}, **fields)  # type: ignore[arg-type]


def test_requirement_above_a_registered_total_is_refused() -> None:
    assert never_runnable(meta(resource_spec={"site-1": {"gpu": 2}}), LAST) == [
        "site 'site-1': gpu 2 > 1 in total on that site"]


def test_busy_but_big_enough_unknown_or_unreported_is_fine() -> None:
    assert never_runnable(meta(resource_spec={"site-1": {"gpu": 1}}), LAST) == []
    assert never_runnable(meta(resource_spec={"site-2": {"gpu": 8}}), LAST) == []
    assert never_runnable(meta(resource_spec={"site-9": {"gpu": 8}}), LAST) == []


def test_mandatory_site_that_never_registered_is_refused() -> None:
    assert never_runnable(meta(mandatory_clients=["site-2", "site-9"]), LAST) == [
        "mandatory site 'site-9' has never registered"]
