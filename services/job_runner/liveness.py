"""Whether a started site has left a running job: the monitor's verdicts, as a pure function of
what the registry shows (no I/O here).

A site is gone, with the reason the server job is told (`SiteGone`), when
* its client job ended (its site agent's final `JobHeartbeat`, `ended`): at once, with the exit
  code or signal and the agent's reason. Exit code 0 is the one normal end (the client job exits
  0 only after the server job said END_RUN): it is recorded, and the site is not gone;
* the site's latest heartbeat, sent after the site started the client job (both by the site's
  clock), does not list the job: "client job is no longer running at the site" (the ended
  notice was lost: it lives only a job TTL, and the runner may have been down meanwhile);
* it went offline after it was seen online: "site went offline";
* its client job stopped reporting after it had reported: "site stopped reporting the job".

The first two rest on what the site itself said, which no gap in the judge's view can fake. The
last two infer an absence from missing data, so they are taken only while the judge trusts its
view for a whole TTL (`trust_sites`, `trust_jobs`; `fedhive.sites.intake.Vigil`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from typing import Any

from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.state.runs import RunEntry, SiteState

# A heartbeat is stamped before it lists the running jobs, and a start's stamp is taken as its
# record becomes what heartbeats list (`SiteAgent._save`): every heartbeat stamped after a start
# lists the job. The slack is a margin on top (clock steps, an agent older than that rule).
LISTING_SLACK_MS = 1000
NOT_RUNNING = "client job is no longer running at the site"
OFFLINE = "site went offline"
SILENT = "site stopped reporting the job"
MAX_REASON = 500  # the agent's reason travels into the job's status reason: keep it a line


@dataclass(frozen=True)
class View:
    """What the registry shows of one site for one job, and whether absences may be judged."""

    online: bool  # in the registry's online set
    site_beat: SiteHeartbeat | None  # the site's live record (None once it expired)
    job_beat: JobHeartbeat | None  # the client job's last beat (None once it expired)
    trust_sites: bool  # the view is whole for a site TTL
    trust_jobs: bool  # ... and for a job TTL


def judge(job_id: str, state: SiteState, view: View) -> tuple[SiteState, str]:
    """`state` updated with what `view` shows, and why the site is gone ('' while it is not)."""
    if not state.started or state.excluded or state.gone or state.ended:
        return state, ""
    beat = view.job_beat
    changes: dict[str, Any] = {}
    if beat is not None and beat.sent_at_ms > state.last_heartbeat_ms:
        changes["last_heartbeat_ms"] = beat.sent_at_ms
    if beat is not None and not state.reported:
        changes["reported"] = True
    if view.online and not state.seen_online:
        changes["seen_online"] = True
    if beat is not None and beat.ended:
        how = ended(beat)
        return replace(state, **changes, ended=how), "" if beat.exit_code == 0 else how
    updated = replace(state, **changes)
    if not_listed(job_id, state, view.site_beat):
        return updated, NOT_RUNNING
    if not view.online and state.seen_online and view.trust_sites:
        return updated, OFFLINE
    if beat is None and state.reported and view.trust_jobs:
        return updated, SILENT
    return updated, ""


def only_beats_moved(before: RunEntry, after: RunEntry) -> bool:
    """Whether `after` differs from `before` in its sites' `last_heartbeat_ms` alone: what
    `fedhive job` shows, and nothing a verdict reads."""
    def without_beats(entry: RunEntry) -> RunEntry:
        return replace(entry, sites={site: replace(state, last_heartbeat_ms=0)
                                     for site, state in entry.sites.items()})

    return without_beats(before) == without_beats(after)


def not_listed(job_id: str, state: SiteState, site_beat: SiteHeartbeat | None) -> bool:
    """The site's heartbeat, sent well after it started the client job, does not list it."""
    return (site_beat is not None and state.started_at_ms > 0
            and site_beat.sent_at_ms >= state.started_at_ms + LISTING_SLACK_MS
            and job_id not in site_beat.running_job_ids)


def ended(beat: JobHeartbeat) -> str:
    """`client job exited with code 1: <why>` / `client job killed by signal 9 (SIGKILL): ...`"""
    code = beat.exit_code
    if code >= 0:
        short = how = f"exited with code {code}"
    else:
        short = f"killed by signal {-code}"
        how = f"{short} ({_signal_name(-code)})"
    why = " ".join(beat.reason.split())
    if len(why) > MAX_REASON:
        why = why[:MAX_REASON] + "…"
    if not why:
        return f"client job {how}"
    if why.startswith(short):  # the agent described the exit itself
        return f"client job {why}"
    return f"client job {how}: {why}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"
