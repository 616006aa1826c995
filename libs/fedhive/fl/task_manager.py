"""The task manager of one server job: FLARE's task queue and its rules (wf_comm_server).

Workflows schedule tasks (`broadcast`, `send`, `relay`); sites ask for work (`next_task`) and
hand in results (`submit`); `check` completes the tasks whose exit rule is met. Pure logic: no
I/O, one lock, an injectable clock. Thread-safe; callbacks run outside the lock (they may
schedule or cancel tasks) and one at a time per task.

    tm = TaskManager(["site-1", "site-2"])
    tm.broadcast(Task("train", dxo), min_responses=2)
    a = tm.next_task("site-1")           # Assignment("task", client_task, data)
    tm.submit("site-1", a.client_task.id, Result(ReturnCode.OK, result_dxo))
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import structlog

from fedhive.errors import InvalidArgument, PermissionDenied
from fedhive.fl.dxo import Dxo
from fedhive.fl.task_rules import (
    BroadcastRule,
    Decision,
    Env,
    Rule,
    SendRule,
    relay_rule,
)
from fedhive.fl.tasks import ClientTask, CompletionStatus, Result, SendOrder, Task

_RETIRED_CACHE_SIZE = 10_000  # finished assignments remembered, to call their results late


@dataclass(frozen=True)
class Assignment:
    kind: Literal["task", "try_again", "end_run"]
    client_task: ClientTask | None = None
    # what to send: the task's data as it was right after before_task_sent_cb (a broadcast's
    # first send fixes it for every site)
    data: Dxo | None = None
    # how many sites get this same data: a broadcast's targets; 1 for a send or a relay, whose
    # data may change between sends
    receivers: int = 1


@dataclass(frozen=True)
class Submission:
    accepted: bool
    reason: str = ""  # why not, when not accepted


_TRY_AGAIN = Assignment("try_again")
_END_RUN = Assignment("end_run")


@dataclass(eq=False)
class _Entry:
    task: Task
    rule: Rule
    cb_lock: threading.RLock = field(default_factory=threading.RLock)
    snapshot: Dxo | None = None
    finishing: bool = False  # completed; its task_done_cb is being run


def _check_non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number, but got {type(value).__name__}.",
                              field=name)
    if value < 0:
        raise InvalidArgument(f"{name} must >= 0.", field=name)


class TaskManager:
    def __init__(self, sites: Sequence[str], *, clock: Callable[[], float] = time.monotonic,
                 log: Any = None, check_period: float = 0.2) -> None:
        self._sites = list(dict.fromkeys(sites))
        self._clock = clock
        self._log = log if log is not None else structlog.get_logger("fedhive.fl.tasks")
        self._check_period = check_period
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # every change wakes its waits (long polls)
        # wakes `wait` (a workflow waiting for its task): a change for every site or a task
        # completed, not one site's result or pick (the submitter runs the exit rules itself)
        self._settled = threading.Condition(lock)
        self._entries: dict[str, _Entry] = {}  # task id -> entry, in scheduling order
        self._live: dict[str, ClientTask] = {}  # assignment id -> assignment of a standing task
        self._retired: OrderedDict[str, tuple[str, str, str]] = OrderedDict()  # id -> site, ...
        self._gone: dict[str, float] = {}
        self._live_sites = frozenset(self._sites)  # the sites not gone
        self._ended = False
        self._version = 0  # bumped on every change
        self._versions = dict.fromkeys(self._sites, 0)  # site -> changes it may care about
        self._seen: dict[str, int] = {}  # site -> its version at its latest next_task
        self._in_callback = threading.local()  # .tasks: ids of tasks whose callback runs here
        self._listeners: list[Callable[[str | None], None]] = []

    # -- scheduling -------------------------------------------------------------------------

    def broadcast(self, task: Task, targets: Sequence[str] | None = None, min_responses: int = 1,
                  wait_time_after_min_received: float = 0) -> None:
        _check_non_negative("min_responses", min_responses)
        _check_non_negative("wait_time_after_min_received", wait_time_after_min_received)
        if targets and min_responses > len(targets):
            raise InvalidArgument(f"min_responses ({min_responses}) must be less than length of "
                                  f"targets ({len(targets)}).", field="min_responses")
        self._schedule(task, targets, BroadcastRule(min_responses, wait_time_after_min_received))

    def send(self, task: Task, targets: Sequence[str], send_order: SendOrder = SendOrder.SEQUENTIAL,
             task_assignment_timeout: float = 0) -> None:
        _check_non_negative("task_assignment_timeout", task_assignment_timeout)
        _check_timeout_fits(task, "task_assignment_timeout", task_assignment_timeout)
        order = _send_order(send_order)
        if not targets:
            raise InvalidArgument("Targets must be provided for send.", field="targets")
        self._schedule(task, targets, SendRule(order, task_assignment_timeout))

    def relay(self, task: Task, targets: Sequence[str] | None = None,
              send_order: SendOrder = SendOrder.SEQUENTIAL, task_assignment_timeout: float = 0,
              task_result_timeout: float = 0, dynamic_targets: bool = True) -> None:
        _check_non_negative("task_assignment_timeout", task_assignment_timeout)
        _check_non_negative("task_result_timeout", task_result_timeout)
        _check_timeout_fits(task, "task_assignment_timeout", task_assignment_timeout)
        _check_timeout_fits(task, "task_result_timeout", task_result_timeout)
        order = _send_order(send_order)
        if targets is None and not dynamic_targets:
            raise InvalidArgument("Need to provide targets when dynamic_targets is set to False.",
                                  field="targets")
        rule = relay_rule(order, task_assignment_timeout, task_result_timeout, dynamic_targets)
        self._schedule(task, targets, rule, keep_duplicates=True)

    def _schedule(self, task: Task, targets: Sequence[str] | None, rule: Rule, *,
                  keep_duplicates: bool = False) -> None:
        with self._cond:
            if task.schedule_time is not None:
                raise InvalidArgument("Task was already used. Please create a new task object.")
            if targets is None:  # a snapshot: sites joining later are not waited for
                names = [site for site in self._sites if site not in self._gone]
            else:
                unknown = [site for site in targets if site not in self._sites]
                if unknown:
                    raise InvalidArgument(f"task {task.name!r}: target site {unknown[0]!r} is not "
                                          "a site of this job", field="targets")
                names = list(targets) if keep_duplicates else list(dict.fromkeys(targets))
            task.targets = names
            task.schedule_time = self._clock()
            self._entries[task.id] = _Entry(task, rule)
            if self._ended:  # no site will ever get it: end it now rather than wait forever
                task.completion_status = CompletionStatus.CANCELLED
            self._changed()
        self._log.info("task.scheduled", task=task.name, task_id=task.id, rule=type(rule).__name__,
                       targets=names)
        if task.completion_status is not None:
            self.check()

    # -- sites ------------------------------------------------------------------------------

    def next_task(self, site: str) -> Assignment:
        """What `site` should do now (FLARE's process_task_request)."""
        with self._cond:
            self._require_site(site)
            if self._ended or site in self._gone:
                return _END_RUN
            picked = self._pick(site)
            if picked is not None:
                self._changed(site)  # a send opens no other site's turn
            self._seen[site] = self._versions[site]
            if picked is None:
                return _TRY_AGAIN
            entry, client_task = picked
        task = entry.task
        with entry.cb_lock:
            self._call(task, task.before_task_sent_cb, client_task, "before_task_sent_cb")
            data = entry.snapshot
            if data is None:
                data = replace(task.data, data=dict(task.data.data), meta=dict(task.data.meta))
                if entry.rule.shared_snapshot:
                    entry.snapshot = data
            self._call(task, task.after_task_sent_cb, client_task, "after_task_sent_cb")
            failed = task.completion_status is not None  # a callback failed or cancelled it
        if failed:
            self.check()
            return _TRY_AGAIN
        return Assignment("task", client_task, data,
                          len(task.targets) if entry.rule.shared_snapshot else 1)

    def _pick(self, site: str) -> tuple[_Entry, ClientTask] | None:
        """Under the lock: the first standing task `site` may get, as an assignment."""
        env = self._env()
        for entry in self._entries.values():
            task = entry.task
            if entry.finishing or task.completion_status is not None:
                continue
            last = task.last_client_task_map.get(site)
            if last is not None and last.result is None and entry.rule.is_current(task, last):
                client_task = last  # sent before and never answered: send the same again
            else:
                decision = entry.rule.check_send(task, site, env)
                if decision is Decision.BLOCK:
                    return None
                if decision is Decision.NO_BLOCK:
                    continue
                client_task = ClientTask(site, task)
                task.client_tasks.append(client_task)
                task.last_client_task_map[site] = client_task
                self._live[client_task.id] = client_task
            client_task.send_count += 1
            client_task.sent_time = env.now
            return entry, client_task
        return None

    def submit(self, site: str, task_id: str, result: Result) -> Submission:
        """Record `site`'s result of assignment `task_id`; a result that is late, unknown or not
        the site's is rejected with the reason (and logged), never raised."""
        with self._cond:
            self._require_site(site)
            client_task = self._live.get(task_id)
            entry = self._entries.get(client_task.task.id) if client_task else None
        if client_task is None or entry is None:
            return self._reject(site, task_id, self._unknown_reason(site, task_id))
        task = entry.task
        with entry.cb_lock:
            with self._cond:
                reason = self._rejection(site, entry, client_task)
                if reason:
                    return self._reject(site, task_id, reason, task=task.name)
                client_task.result = result
            self._call(task, task.result_received_cb, client_task, "result_received_cb")
            with self._cond:
                client_task.result_received_time = self._clock()
                task.answered[site] += 1
                self._changed(None if entry.rule.results_open_turns else site)
        self._log.info("task.result_received", task=task.name, task_id=task_id, site=site,
                       return_code=result.return_code)
        self.check()
        return Submission(True)

    def _unknown_reason(self, site: str, task_id: str) -> str:
        with self._cond:
            retired = self._retired.get(task_id)
        if retired is None:
            return f"unknown task id {task_id!r}"
        assignee, name, status = retired
        if assignee != site:
            return f"task id {task_id!r} was not assigned to site {site!r}"
        return f"late result: task {name!r} already finished ({status})"

    def _rejection(self, site: str, entry: _Entry, client_task: ClientTask) -> str:
        task = entry.task
        if client_task.site != site:
            return f"task id {client_task.id!r} was not assigned to site {site!r}"
        if client_task.result_received_time is not None or client_task.result is not None:
            return f"duplicate result: task {task.name!r} already has this site's result"
        if entry.finishing or task.completion_status is not None:
            status = task.completion_status.value if task.completion_status else "finishing"
            return f"late result: task {task.name!r} already finished ({status})"
        if not entry.rule.is_current(task, client_task):
            return f"late result: task {task.name!r} has moved on to another site"
        return ""

    def _reject(self, site: str, task_id: str, reason: str, **fields: Any) -> Submission:
        self._log.warning("task.result_rejected", site=site, task_id=task_id, reason=reason,
                          **fields)
        return Submission(False, reason)

    # -- completion -------------------------------------------------------------------------

    def check(self) -> list[Task]:
        """Complete every task whose exit rule is met (or that was cancelled), calling each
        one's task_done_cb once; returns the tasks completed by this call."""
        finished: list[_Entry] = []
        busy = self._busy()
        with self._cond:
            env = self._env()
            for entry in self._entries.values():
                task = entry.task
                if entry.finishing or task.id in busy:
                    continue  # a task cancelled from its own callback completes after it returns
                if task.completion_status is None:
                    status = entry.rule.check_exit(task, env)
                    if status is None and _timed_out(task, env.now):
                        status = CompletionStatus.TIMEOUT
                    if status is None:
                        continue
                    task.completion_status = status
                entry.finishing = True
                finished.append(entry)
                for client_task in task.client_tasks:
                    self._live.pop(client_task.id, None)
                    self._retired[client_task.id] = (client_task.site, task.name, _status_of(task))
                while len(self._retired) > _RETIRED_CACHE_SIZE:
                    self._retired.popitem(last=False)
        for entry in finished:
            task = entry.task
            with entry.cb_lock:
                self._call(task, task.task_done_cb, task, "task_done_cb")
                self._log.info("task.completed", task=task.name, task_id=task.id,
                               status=_status_of(task),
                               results=sum(ct.result is not None for ct in task.client_tasks))
            with self._cond:
                del self._entries[task.id]
                self._changed()
        return [entry.task for entry in finished]

    def cancel(self, task: Task, status: CompletionStatus = CompletionStatus.CANCELLED) -> None:
        """End a standing task with `status` (a task that already completed keeps its own)."""
        with self._cond:
            entry = self._entries.get(task.id)
            if entry is None or entry.finishing or task.completion_status is not None:
                return
            task.completion_status = status
        self.check()

    def cancel_all(self, status: CompletionStatus = CompletionStatus.CANCELLED) -> None:
        with self._cond:
            for entry in self._entries.values():
                if not entry.finishing and entry.task.completion_status is None:
                    entry.task.completion_status = status
        self.check()

    def site_gone(self, site: str) -> None:
        """`site` left the job: it is no longer waited for, and gets "end_run" if it asks."""
        with self._cond:
            if site not in self._sites or site in self._gone:
                return
            self._gone[site] = self._clock()
            self._live_sites = self._live_sites - {site}
            self._changed()
        self._log.warning("task.site_gone", site=site)
        self.check()

    def end_run(self) -> None:
        """Cancel every standing task; from now on every site asking for work gets "end_run"."""
        with self._cond:
            self._ended = True
            self._changed()
        self.cancel_all()

    # -- waiting ----------------------------------------------------------------------------

    def wait(self, task: Task, abort: threading.Event | None = None) -> None:
        """Block until `task` has completed (its task_done_cb has run); `abort` set cancels it
        with ABORTED first. Checks exit rules itself, so it needs no monitor thread."""
        if task.schedule_time is None:
            raise InvalidArgument(f"task {task.name!r} was never scheduled")
        while True:
            with self._cond:
                if task.id not in self._entries:
                    return
            if abort is not None and abort.is_set():
                self.cancel(task, CompletionStatus.ABORTED)
            self.check()
            with self._cond:
                if task.id in self._entries:
                    self._settled.wait(self._check_period)

    def wait_for_work(self, timeout: float, site: str | None = None) -> bool:
        """For a site polling in a loop of its own (the task server parks its polls instead):
        wait until a task is scheduled, sent, answered or completed, a site goes or the run
        ends (True), or until `timeout` (False). With `site`, only changes that
        concern it count (not another site's send, nor its result under a rule where results
        open no turns), and one since the site's latest next_task returns at once. Turns that
        open only as time passes (send and relay assignment timeouts) are seen at the next
        poll."""
        with self._cond:
            if site is None:
                since = self._version
                return self._cond.wait_for(lambda: self._version != since, timeout)
            self._require_site(site)
            since = self._seen.get(site, self._versions[site])
            return self._cond.wait_for(lambda: self._versions[site] != since, timeout)

    def on_change(self, listener: Callable[[str | None], None]) -> None:
        """Call `listener(site)` on every change (None: one for every site), as `changed_for`
        counts them; under the manager's lock, so it may only take note (set a flag)."""
        with self._cond:
            self._listeners.append(listener)

    def turns_open_by_clock(self) -> bool:
        """Whether a standing task can make a site eligible as time passes alone."""
        with self._cond:
            return any(entry.rule.turns_open_by_clock for entry in self._entries.values())

    def changed_for(self, sites: Iterable[str]) -> list[str]:
        """Of `sites`, those a change concerned since their latest next_task (as
        `wait_for_work` with a site counts them)."""
        with self._cond:
            return [site for site in sites if self._seen.get(site) != self._versions[site]]

    # -- views ------------------------------------------------------------------------------

    def standing(self) -> list[Task]:
        with self._cond:
            return [entry.task for entry in self._entries.values() if not entry.finishing]

    def active_sites(self) -> list[str]:
        """The job's sites that are not gone, in the job's order."""
        with self._cond:
            return [site for site in self._sites if site not in self._gone]

    # -- helpers ----------------------------------------------------------------------------

    def _env(self) -> Env:
        return Env(self._clock(), dict(self._gone), self._live_sites)

    def _changed(self, site: str | None = None) -> None:
        """Under the lock: count a change for every site, or with `site` for that site alone
        (what `changed_for` and `wait_for_work` with a site look at), and wake the waits."""
        self._version += 1
        for name in self._sites if site is None else (site,):
            self._versions[name] += 1
        self._cond.notify_all()
        if site is None:
            self._settled.notify_all()
        for listener in self._listeners:
            listener(site)

    def _require_site(self, site: str) -> None:
        if site not in self._sites:
            raise PermissionDenied(f"site {site!r} is not a site of this job", field="site")

    def _call(self, task: Task, callback: Callable[[Any], Any] | None, arg: Any,
              name: str) -> None:
        """Run a task callback; one that raises ends the task with ERROR."""
        if callback is None:
            return
        busy = self._busy()
        busy.append(task.id)
        try:
            callback(arg)
        except Exception:
            self._log.exception("task.callback_failed", task=task.name, task_id=task.id,
                                callback=name)
            with self._cond:
                task.completion_status = CompletionStatus.ERROR
        finally:
            busy.pop()

    def _busy(self) -> list[str]:
        """Ids of the tasks whose callbacks this thread is running (innermost last)."""
        if not hasattr(self._in_callback, "tasks"):
            self._in_callback.tasks = []
        tasks: list[str] = self._in_callback.tasks
        return tasks


def _timed_out(task: Task, now: float) -> bool:
    return bool(task.timeout) and task.schedule_time is not None \
        and now - task.schedule_time >= task.timeout


def _status_of(task: Task) -> str:
    return task.completion_status.value if task.completion_status else "standing"


def _check_timeout_fits(task: Task, name: str, value: float) -> None:
    if task.timeout and value and value > task.timeout:
        raise InvalidArgument(f"{name} ({value}) needs to be less than or equal to task.timeout "
                              f"({task.timeout}).", field=name)


def _send_order(value: SendOrder | str) -> SendOrder:
    try:
        return SendOrder(value)
    except ValueError:
        raise InvalidArgument(f"send_order must be one of {[order.value for order in SendOrder]}, "
                              f"got {value!r}", field="send_order") from None
