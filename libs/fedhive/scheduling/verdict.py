"""Runnability: from the sites' check_resources answers to run-or-wait (pure).

A job is runnable iff the sites that said yes number at least `min_sites` and include every
mandatory client. Runnable: it runs on the sites that said yes (a site that said no is left
out, as in FLARE). Not runnable: every reservation made is cancelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fedhive.scheduling.policy import Placement

NO_ANSWER = "no answer (check timeout)"


@dataclass(frozen=True)
class SiteAnswer:
    ok: bool
    token: str = ""  # the reservation, when ok
    reason: str = ""  # why not, when not ok


@dataclass(frozen=True)
class Verdict:
    runnable: bool
    reservations: dict[str, str]  # site -> token of every site that said yes
    refusals: dict[str, str] = field(default_factory=dict)  # site -> why not
    reason: str = ""  # one line, when not runnable

    @property
    def chosen(self) -> list[str]:
        return list(self.reservations) if self.runnable else []

    @property
    def to_cancel(self) -> dict[str, str]:
        """Reservations to give back: all of them when the job does not run."""
        return {} if self.runnable else dict(self.reservations)


def judge(placement: Placement, answers: Mapping[str, SiteAnswer]) -> Verdict:
    """Decide from the answers of `placement.sites` (a site missing from `answers` said no)."""
    reservations: dict[str, str] = {}
    refusals: dict[str, str] = {}
    for site in placement.sites:
        answer = answers.get(site)
        if answer is None:
            refusals[site] = NO_ANSWER
        elif answer.ok:
            reservations[site] = answer.token
        else:
            refusals[site] = answer.reason or "not enough resources"
    details = "; ".join(f"{site}: {why}" for site, why in refusals.items())
    failing_required = [site for site in placement.required if site not in reservations]
    if len(reservations) < placement.min_sites:
        reason = (f"not enough sites have enough resources (ok sites {len(reservations)} < "
                  f"min sites {placement.min_sites})")
    elif failing_required:
        reason = f"mandatory sites {', '.join(failing_required)} do not have enough resources"
    else:
        return Verdict(True, reservations, refusals)
    if details:
        reason += f". Details: {details}"
    return Verdict(False, reservations, refusals, reason)
