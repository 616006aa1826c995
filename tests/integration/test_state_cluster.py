"""What a Redis Cluster adds (the contract suites run on it through `state_store`): where the
keys land (a job's data in one slot, jobs spread over the nodes, every namespace key in the
namespace's slot), the round log, runs table and job logs on it, job heartbeats of several
jobs in one call, and cluster mode set wrong named in one line."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot

from fedhive.config import Settings
from fedhive.errors import ConfigError
from fedhive.joblogs.lines import Line
from fedhive.joblogs.wire import CLIENT_JOB
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.sites.heartbeat import JobHeartbeat
from fedhive.state import RedisStateStore
from fedhive.state.connect import redis_client
from fedhive.state.joblogs import DONE, JobLogStore
from fedhive.state.rounds import RoundLog
from fedhive.state.runs import Outcome, RunEntry, RunTable
from tests.fixtures.redis_servers import RedisClusterNodes
from tests.fixtures.state import submit, submit_in

JOBS = [f"job-{i}" for i in range(12)]


@pytest.fixture
def cluster(cluster_settings: Settings) -> Iterator[RedisCluster]:
    client = RedisCluster.from_url(cluster_settings.redis_url, decode_responses=True)
    yield client
    client.close()


def _job_data_keys(names: Names, job_id: str) -> list[str]:
    return [names.job_live_key(job_id), names.job_rounds_key(job_id),
            *names.job_log_keys(job_id), names.job_heartbeat_key(job_id, "site-1"),
            names.server_job_alive_key(job_id), names.server_job_stop_key(job_id),
            names.server_job_outcome_key(job_id)]


def _namespace_keys(names: Names, job_id: str) -> list[str]:
    return [names.job_key(job_id), names.job_history_key(job_id), names.jobs_by_submit_key,
            *(names.jobs_by_status_key(s.value) for s in JobStatus), names.site_key("site-1"),
            names.sites_key, names.sites_online_key, names.sites_last_key, names.runs_key,
            names.lease_key("scheduler"), names.fence_key("scheduler"),
            names.idempotency_key("job-store", "m1")]


def _port_of(cluster: RedisCluster, key: str) -> int:
    node = cluster.get_node_from_key(key)  # type: ignore[no-untyped-call]
    return int(node.port)


def _keys_per_node(nodes: RedisClusterNodes, names: Names) -> dict[int, set[str]]:
    """The namespace's keys each node really holds (a plain client per node)."""
    held: dict[int, set[str]] = {}
    for port in nodes.ports:
        client = redis.Redis(port=port, decode_responses=True)
        try:
            held[port] = {key for pattern in names.redis_patterns
                          for key in client.scan_iter(match=pattern, count=1000)}
        finally:
            client.close()
    return held


def test_a_jobs_data_shares_a_slot_and_jobs_spread_over_the_nodes(
    cluster_state: RedisStateStore, cluster_settings: Settings, redis_cluster: RedisClusterNodes,
) -> None:
    """Each job's data in its one slot; every record, index, site, lease in the namespace's."""
    names = Names(cluster_settings.namespace)
    rounds = RoundLog.from_settings(cluster_settings)
    try:
        for job_id in JOBS:
            submit(cluster_state, job_id)
            rounds.append(job_id, {"round": 0})
    finally:
        rounds.close()
    for job_id in JOBS:
        assert len({key_slot(key.encode()) for key in _job_data_keys(names, job_id)}) == 1
    namespace_slots = {key_slot(key.encode()) for job_id in JOBS
                       for key in _namespace_keys(names, job_id)}
    assert len(namespace_slots) == 1

    held = _keys_per_node(redis_cluster, names)
    holders = {port for port, keys in held.items()
               if any(names.job_rounds_key(job_id) in keys for job_id in JOBS)}
    assert len(holders) > 1, held  # the jobs' data is spread over the shards
    [records] = [port for port, keys in held.items() if names.job_key(JOBS[0]) in keys]
    assert all(names.job_key(job_id) in held[records] for job_id in JOBS)


def test_round_log_runs_table_and_job_logs_on_the_cluster(
    cluster_state: RedisStateStore, cluster_settings: Settings, cluster: RedisCluster,
) -> None:
    names = Names(cluster_settings.namespace)
    submit_in(cluster_state, "j1", JobStatus.RUNNING)
    rounds = RoundLog.from_settings(cluster_settings)
    runs = RunTable.from_settings(cluster_settings)
    logs = JobLogStore.from_settings(cluster_settings)
    try:
        rounds.append("j1", {"round": 0, "metrics": {"aggregate": {"loss": 1.0}}})
        assert rounds.read("j1") == [{"round": 0, "metrics": {"aggregate": {"loss": 1.0}}}]

        runs.put(RunEntry("j1", "runner-a", 7, "running").with_site("site-1", started=True))
        assert [entry.job_id for entry in runs.all()] == ["j1"]
        entry = runs.get("j1")
        assert entry == runs.all()[0] and entry is not None and entry.sites["site-1"].started
        assert runs.beat("j1", 123, 30) is False and runs.alive("j1")
        runs.ask_stop("j1")
        assert runs.beat("j1", 123, 30) is True
        assert runs.report("j1", Outcome("completed")) and not runs.alive("j1")
        assert runs.outcome("j1") == Outcome("completed")
        runs.remove("j1", 7)
        assert runs.get("j1") is None

        stored = logs.append("j1", "site-1", CLIENT_JOB, 0,
                             [Line(5, "one", False), Line(12, "two: Error", True)], eof=True)
        assert stored == 2
        assert [e.line for e in logs.read("j1").lines] == ["one", "two: Error"]
        assert logs.sites("j1") == {"site-1": DONE}
        assert logs.last_errors("j1") and logs.stored_up_to("j1", "site-1") == 12

        cluster_state.change_status("j1", JobStatus.RUNNING, JobStatus.FINISHED_COMPLETED, "done")
        assert cluster_state.delete_job("j1")
        assert logs.append("j1", "site-1", CLIENT_JOB, 12, [Line(20, "late", False)]) is None
        assert cluster.exists(names.job_rounds_key("j1"), *names.job_log_keys("j1"),
                              names.job_live_key("j1"), names.job_key("j1")) == 0
        assert cluster_state.recent_job_ids() == []
    finally:
        for store in (rounds, runs, logs):
            store.close()


def test_heartbeats_of_several_jobs_in_one_call(cluster_state: RedisStateStore) -> None:
    beats = [JobHeartbeat(job_id, "site-1", sent_at_ms=1, progress=0.5) for job_id in JOBS]
    cluster_state.record_job_heartbeats(beats, ttl_s=60)
    assert [cluster_state.get_job_heartbeat(job_id, "site-1") for job_id in JOBS] == beats
    sites = [JobHeartbeat(JOBS[0], f"site-{n}", sent_at_ms=1) for n in range(2, 6)]
    cluster_state.record_job_heartbeats(sites, ttl_s=60)
    read = cluster_state.get_job_heartbeats(JOBS[0], [f"site-{n}" for n in range(1, 7)])
    assert read == {beat.site: beat for beat in [beats[0], *sites]}  # one job's keys: one slot


def test_cluster_mode_set_wrong_is_one_line(
    cluster_settings: Settings, settings: Settings, cluster: RedisCluster,
    redis_cluster: RedisClusterNodes,
) -> None:
    # A namespace whose slot the first node does not serve: the first node answers MOVED.
    first = redis_cluster.ports[0]
    namespace = next(ns for ns in (f"{settings.namespace}-{i}" for i in itertools.count())
                     if _port_of(cluster, Names(ns).jobs_by_submit_key) != first)
    plain = RedisStateStore.from_settings(
        replace(cluster_settings, redis_cluster=False, namespace=namespace))
    try:
        with pytest.raises(ConfigError, match=rf"^redis at 127\.0\.0\.1:{first} is a Redis "
                                              r"Cluster node \(it answered MOVED\): set "
                                              r"FEDHIVE_REDIS_CLUSTER=1$") as raised:
            plain.get_job("job-1")
        assert raised.value.field == "FEDHIVE_REDIS_CLUSTER"
    finally:
        plain.close()

    with pytest.raises(ConfigError, match=r"^redis at 127\.0\.0\.1:\d+ is not a Redis Cluster: "
                                          r"unset FEDHIVE_REDIS_CLUSTER$"):
        redis_client(replace(settings, redis_cluster=True))


def test_a_crash_between_the_slots_steps_is_finished_by_a_retry(
    cluster_state: RedisStateStore, cluster_settings: Settings, cluster: RedisCluster,
) -> None:
    """create_job and delete_job touch the job's slot, then the namespace's: the state a
    crash between the two leaves is what the same call, retried, completes."""
    names = Names(cluster_settings.namespace)
    logs = JobLogStore.from_settings(cluster_settings)
    try:
        cluster.set(names.job_live_key("j1"), "1")  # create_job got this far
        assert submit(cluster_state, "j1").job_id == "j1"  # the retry
        assert logs.append("j1", "site-1", CLIENT_JOB, 0, [Line(4, "one", False)]) == 1

        cluster.delete(names.job_live_key("j1"), *names.job_log_keys("j1"))  # delete_job's 1st
        assert cluster_state.recent_job_ids() == ["j1"]  # still listed: it can be retried
        assert logs.append("j1", "site-1", CLIENT_JOB, 4, [Line(8, "late", False)]) is None
        assert cluster_state.delete_job("j1")  # the retry
        assert cluster_state.recent_job_ids() == []
        assert cluster.exists(names.job_key("j1"), names.job_history_key("j1"),
                              *names.job_log_keys("j1")) == 0
    finally:
        logs.close()
