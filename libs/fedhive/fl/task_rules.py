"""Per-kind assignment and exit rules of the task manager (FLARE's bcast/send/relay managers).

Each scheduled task gets one rule. The task manager asks it, under its lock:

* `check_send(task, site, env)`: may `site` (which holds no unanswered current assignment of
  this task) be given the task now? SEND, NO_BLOCK (not this task, look at the next one) or
  BLOCK (not now, and give the site nothing else either: it must stay free for its turn);
* `check_exit(task, env)`: the status the task completes with, or None to keep waiting;
* `is_current(task, client_task)`: is this assignment still the one the task waits for?
  A relay that moved on to the next site no longer waits for the previous one: that site's
  late result is rejected and its assignment is not resent.

Gone sites (`env.gone`) are "not responding": send and relay skip them when it is their turn,
a broadcast stops waiting for them, and a task that no live site can finish ends CLIENT_DEAD.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from fedhive.fl.tasks import ClientTask, CompletionStatus, SendOrder, Task


class Decision(enum.Enum):
    SEND = "send"
    NO_BLOCK = "no_block"
    BLOCK = "block"


@dataclass(frozen=True)
class Env:
    now: float
    gone: Mapping[str, float]  # site -> when it went gone (the manager's clock)
    live_sites: frozenset[str]  # the job's sites that are not gone


class Rule:
    shared_snapshot = False  # True: every site gets the data as it was at the first send
    # Whether one site's result can open another site's turn (the next in a relay): when not,
    # a result wakes none of the other sites' long polls.
    results_open_turns = True

    @property
    def turns_open_by_clock(self) -> bool:
        """Whether time alone can make a site eligible (a send's or relay's timeouts): its
        waiting sites must then be asked again as time passes, not only on a change."""
        return False

    def check_send(self, task: Task, site: str, env: Env) -> Decision:
        raise NotImplementedError

    def check_exit(self, task: Task, env: Env) -> CompletionStatus | None:
        raise NotImplementedError

    def is_current(self, task: Task, client_task: ClientTask) -> bool:
        return True


def _all_lacking_gone(task: Task, env: Env) -> bool:
    """Every target still lacking a result is gone (FLARE's dead-client rule)."""
    return all(site in env.gone for site in task.targets if not task.answered[site])


class BroadcastRule(Rule):
    shared_snapshot = True
    results_open_turns = False

    def __init__(self, min_responses: int, wait_time_after_min_received: float) -> None:
        self.min_responses = min_responses
        self.wait_time = wait_time_after_min_received
        self.min_met_time: float | None = None
        self._targets: frozenset[str] | None = None  # task.targets, fixed once scheduled

    def check_send(self, task: Task, site: str, env: Env) -> Decision:
        if site in task.last_client_task_map or site not in task.targets:
            return Decision.NO_BLOCK
        return Decision.SEND

    def check_exit(self, task: Task, env: Env) -> CompletionStatus | None:
        targets = task.targets
        if not targets:
            return CompletionStatus.CLIENT_DEAD  # nobody can ever answer
        # Checked on every result: costs the gone sites, not the targets. A broadcast sends
        # only to its (distinct) targets, so every answering site is one.
        answered = task.answered
        responded = len(answered)
        if responded >= len(targets):
            return CompletionStatus.OK
        # min_responses 0 means all; more than the targets (a snapshot) also waits for all
        need = len(targets) if not 0 < self.min_responses <= len(targets) else self.min_responses
        if self._targets is None:
            self._targets = frozenset(targets)
        waiting_for = len(targets) - responded - sum(
            1 for site in env.gone if site in self._targets and site not in answered)
        if responded + waiting_for < need:
            return CompletionStatus.CLIENT_DEAD  # the minimum can no longer be met
        if not waiting_for:
            return CompletionStatus.OK  # the minimum is met and everyone else is gone
        if self.min_responses == 0 or responded == 0 or responded < self.min_responses:
            return None
        if self.min_met_time is None:
            self.min_met_time = env.now
        if env.now - self.min_met_time >= self.wait_time:
            return CompletionStatus.OK
        return None


class SendRule(Rule):
    """Only one site ever gets the task. SEQUENTIAL: the first live target may take it; every
    `task_assignment_timeout` one more target becomes eligible; a later target asking early is
    BLOCKed. ANY: the first target to ask."""

    def __init__(self, send_order: SendOrder, task_assignment_timeout: float) -> None:
        self.send_order = send_order
        self.assignment_timeout = task_assignment_timeout

    @property
    def turns_open_by_clock(self) -> bool:
        return bool(self.assignment_timeout) and self.send_order != SendOrder.ANY

    def check_send(self, task: Task, site: str, env: Env) -> Decision:
        if task.client_tasks or site not in task.targets or site in env.gone:
            return Decision.NO_BLOCK
        if self.send_order == SendOrder.ANY:
            return Decision.SEND
        live = [target for target in task.targets if target not in env.gone]
        eligible = 0
        if self.assignment_timeout:
            eligible = int((env.now - _scheduled(task)) / self.assignment_timeout)
        return Decision.SEND if live.index(site) <= eligible else Decision.BLOCK

    def check_exit(self, task: Task, env: Env) -> CompletionStatus | None:
        if not task.client_tasks:
            gone = all(target in env.gone for target in task.targets)
            return CompletionStatus.CLIENT_DEAD if gone else None
        holder = task.client_tasks[0]
        if holder.result_received_time is not None:
            return CompletionStatus.OK
        return CompletionStatus.CLIENT_DEAD if holder.site in env.gone else None


class _RelayRule(Rule):
    def __init__(self, task_result_timeout: float, dynamic_targets: bool) -> None:
        self.result_timeout = task_result_timeout
        self.dynamic_targets = dynamic_targets

    @property
    def turns_open_by_clock(self) -> bool:
        return bool(self.result_timeout)

    def is_current(self, task: Task, client_task: ClientTask) -> bool:
        return bool(task.client_tasks) and task.client_tasks[-1] is client_task

    def _join(self, task: Task, site: str) -> None:
        if self.dynamic_targets and site not in task.targets:
            task.targets.append(site)

    def _released_at(self, client_task: ClientTask, env: Env) -> float | None:
        """When the relay stopped waiting for this assignment: its result came, its result
        timeout passed or its site went gone; None while it is still awaited."""
        if client_task.result_received_time is not None:
            return client_task.result_received_time
        if client_task.site in env.gone:
            return env.gone[client_task.site]
        sent = client_task.sent_time if client_task.sent_time is not None else env.now
        if self.result_timeout and env.now - sent > self.result_timeout:
            return sent + self.result_timeout
        return None


class _Window(enum.Enum):
    WAIT = "wait"  # the current site has not answered yet
    END = "end"  # no turn left


class SequentialRelayRule(_RelayRule):
    """Targets take the task in list order, one at a time. After the current site answers (or
    its result timeout passes, or it goes gone) the next live target may take it; every
    `task_assignment_timeout` without a taker opens the turn to one more target. When the turns
    run out the task ends: OK if the last assignment was answered."""

    def __init__(self, task_assignment_timeout: float, task_result_timeout: float,
                 dynamic_targets: bool) -> None:
        super().__init__(task_result_timeout, dynamic_targets)
        self.assignment_timeout = task_assignment_timeout
        self.last_index = -1  # position in targets of the latest send

    @property
    def turns_open_by_clock(self) -> bool:
        return bool(self.result_timeout or self.assignment_timeout)

    def _window(self, task: Task, env: Env) -> list[int] | _Window:
        start, since = 0, _scheduled(task)
        if self.last_index >= 0:
            released = self._released_at(task.client_tasks[-1], env)
            if released is None:
                return _Window.WAIT
            start, since = self.last_index + 1, released
        remaining = [i for i in range(start, len(task.targets)) if task.targets[i] not in env.gone]
        if not remaining:
            return _Window.END
        size = 1
        if self.assignment_timeout:
            size = int((env.now - since) / self.assignment_timeout) + 1
            if size > len(remaining) + 1:  # as FLARE: the last one had its turn and one more
                return _Window.END
        return remaining[:size]

    def check_send(self, task: Task, site: str, env: Env) -> Decision:
        self._join(task, site)
        if site not in task.targets:
            return Decision.NO_BLOCK
        window = self._window(task, env)
        if isinstance(window, _Window):
            return Decision.BLOCK
        for index in window:
            if task.targets[index] == site:
                self.last_index = index
                return Decision.SEND
        return Decision.NO_BLOCK

    def check_exit(self, task: Task, env: Env) -> CompletionStatus | None:
        if not task.targets:
            return None if env.live_sites else CompletionStatus.CLIENT_DEAD
        if self._window(task, env) is not _Window.END:
            return None
        if task.client_tasks and task.client_tasks[-1].result_received_time is not None:
            return CompletionStatus.OK
        return CompletionStatus.CLIENT_DEAD if _all_lacking_gone(task, env) \
            else CompletionStatus.TIMEOUT


class AnyRelayRule(_RelayRule):
    """Targets take the task in whatever order they ask, one at a time, each as many times as it
    appears in targets. Ends OK when every live target has answered all its turns."""

    def check_send(self, task: Task, site: str, env: Env) -> Decision:
        self._join(task, site)
        if site not in task.targets or task.answered[site] >= task.targets.count(site):
            return Decision.NO_BLOCK
        if task.client_tasks and self._released_at(task.client_tasks[-1], env) is None:
            return Decision.BLOCK  # one site at a time
        return Decision.SEND

    def check_exit(self, task: Task, env: Env) -> CompletionStatus | None:
        if not task.targets:
            return None if env.live_sites else CompletionStatus.CLIENT_DEAD
        if task.client_tasks and self._released_at(task.client_tasks[-1], env) is None:
            return None
        answered = task.answered
        if any(answered[site] < task.targets.count(site)
               for site in set(task.targets) if site not in env.gone):
            return None
        if any(ct.result_received_time is not None for ct in task.client_tasks):
            return CompletionStatus.OK
        return CompletionStatus.CLIENT_DEAD


def _scheduled(task: Task) -> float:
    assert task.schedule_time is not None, "rules only see scheduled tasks"
    return task.schedule_time


def relay_rule(send_order: SendOrder, task_assignment_timeout: float,
               task_result_timeout: float, dynamic_targets: bool) -> Rule:
    if send_order == SendOrder.SEQUENTIAL:
        return SequentialRelayRule(task_assignment_timeout, task_result_timeout, dynamic_targets)
    return AnyRelayRule(task_result_timeout, dynamic_targets)
