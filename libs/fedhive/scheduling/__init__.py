"""Scheduling decisions (issue 6): which SUBMITTED job may run now, on which sites, and why the
others wait. Pure logic over the state/bus ports with an injected clock; the
`fedhive-scheduler` service (services/scheduler) runs it under a leader lease.

* `policy`: the DefaultJobScheduler parameters, retry intervals, deploy-map resolution.
* `verdict`: runnability from the sites' check_resources answers.
* `reasons`: the structured pending reason a waiting job carries.
* `scheduler`: one scheduling pass (`Scheduler.run_pass`).
"""

from fedhive.scheduling.policy import Placement, SchedulerConfig, resolve_placement
from fedhive.scheduling.scheduler import Scheduler
from fedhive.scheduling.verdict import SiteAnswer, Verdict, judge

__all__ = [
    "Placement",
    "Scheduler",
    "SchedulerConfig",
    "SiteAnswer",
    "Verdict",
    "judge",
    "resolve_placement",
]
