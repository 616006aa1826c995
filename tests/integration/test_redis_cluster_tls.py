"""Redis Cluster over TLS, what ElastiCache cluster mode with in-transit encryption and
Memorystore Cluster are: a 3-master cluster whose nodes speak TLS only (between themselves
too), with a certificate of a test-made CA for the address they announce (127.0.0.1). The state
store, round log and job logs work over `rediss://` with FEDHIVE_REDIS_CLUSTER=1 and the CA;
every node, those the slot map names and those a MOVED redirect names, is spoken to over TLS
with its certificate verified; a CA that does not match is refused at the cluster's first
contact in one line, once."""

from __future__ import annotations

import itertools
import ssl
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster
from redis.crc import key_slot

from fedhive.config import Settings
from fedhive.errors import ConfigError
from fedhive.joblogs.lines import Line
from fedhive.joblogs.wire import CLIENT_JOB
from fedhive.jobs.status import JobStatus
from fedhive.names import Names
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.state import RedisStateStore
from fedhive.state.connect import redis_client, where
from fedhive.state.joblogs import JobLogStore
from fedhive.state.rounds import RoundLog
from tests.fixtures.certs import CertAuthority
from tests.fixtures.infra import wait_for
from tests.fixtures.redis_servers import RedisClusterNodes, ServerTls
from tests.fixtures.state import submit, submit_in

JOBS = [f"job-{i}" for i in range(40)]  # enough that each node holds some
NODE_NAMES = (("DNS", "localhost"), ("IP Address", "127.0.0.1"))
REFUSED = "Error accepting a client connection"  # a node's log line for a failed handshake


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("redis-cluster-tls")


@pytest.fixture(scope="module")
def ca(tls_dir: Path) -> CertAuthority:
    return CertAuthority.create(tls_dir / "ca")


@pytest.fixture(scope="module")
def tls_cluster(tls_dir: Path, ca: CertAuthority) -> Iterator[RedisClusterNodes]:
    # `client`: the nodes show it to each other on the cluster bus, which always asks for one.
    cert = ca.issue("redis-node", dns=("localhost",), ips=("127.0.0.1",), client=True)
    with RedisClusterNodes(tls_dir / "nodes", tls=ServerTls(cert, ca.pem)) as nodes:
        yield nodes


@pytest.fixture
def tls_settings(tls_cluster: RedisClusterNodes, ca: CertAuthority, namespace: str) -> Settings:
    """The module's cluster is its own and goes with it: its keys need no deleting."""
    return Settings(redis_url=tls_cluster.url, redis_ca_file=str(ca.pem), redis_cluster=True,
                    namespace=namespace)


@pytest.fixture
def client(tls_settings: Settings) -> Iterator[RedisCluster]:
    """A cluster client from fedhive's one factory, shared by the stores a test builds on it."""
    made = redis_client(tls_settings)
    assert isinstance(made, RedisCluster)
    yield made
    made.close()


def _verified_peer(client: RedisCluster, port: int) -> Any:
    """The names in the certificate the node on `port` showed `client`, as TLS verified it
    (an unverified peer's certificate reads as {})."""
    node = client.get_node(host="127.0.0.1", port=port)  # type: ignore[no-untyped-call]
    pool = node.redis_connection.connection_pool
    connection = pool.get_connection()
    try:
        sock = connection._sock
        assert isinstance(sock, ssl.SSLSocket), f"node {port} spoken to without TLS"
        return (sock.getpeercert() or {}).get("subjectAltName")
    finally:
        pool.release(connection)


def _port_of(client: RedisCluster, key: str) -> int:
    """The node `client` sends `key` to, by the slot map it holds now."""
    return int(client.get_node_from_key(key).port)  # type: ignore[no-untyped-call]


def test_the_state_store_round_log_and_job_logs_work_over_tls(tls_settings: Settings) -> None:
    store = RedisStateStore.from_settings(tls_settings)
    rounds = RoundLog.from_settings(tls_settings)
    logs = JobLogStore.from_settings(tls_settings)
    try:
        submit_in(store, "j1", JobStatus.RUNNING)
        store.change_status("j1", JobStatus.RUNNING, JobStatus.FINISHED_COMPLETED, "done")
        assert store.get_job("j1").status is JobStatus.FINISHED_COMPLETED
        submit(store, "j2")
        assert store.recent_job_ids() == ["j2", "j1"]
        assert [job.job_id for job in store.list_jobs(JobStatus.SUBMITTED)] == ["j2"]

        token = store.acquire("scheduler", "a", 30)
        assert token is not None and store.acquire("scheduler", "b", 30) is None
        store.renew("scheduler", "a", token, 60)
        lease = store.get_lease("scheduler")
        assert lease is not None and (lease.holder, lease.token) == ("a", token)
        assert store.release("scheduler", "a", token) and store.get_lease("scheduler") is None

        site = SiteHeartbeat("site-1", running_job_ids=["j2"], sent_at_ms=5)
        store.record_heartbeats([site], ttl_s=60)
        assert store.get_site("site-1") == site and store.online_sites() == ["site-1"]
        assert store.live_sites() == [site]
        beats = [JobHeartbeat(job_id, "site-1", sent_at_ms=1, progress=0.5) for job_id in JOBS]
        store.record_job_heartbeats(beats, ttl_s=60)
        assert [store.get_job_heartbeat(job_id, "site-1") for job_id in JOBS] == beats

        rounds.append("j2", {"round": 0})
        assert rounds.read("j2") == [{"round": 0}]
        assert logs.append("j2", "site-1", CLIENT_JOB, 0, [Line(4, "hello", False)]) == 1
        assert [entry.line for entry in logs.read("j2").lines] == ["hello"]

        assert store.delete_job("j1") and store.recent_job_ids() == ["j2"]
    finally:
        for closing in (store, rounds, logs):
            closing.close()


def test_every_node_is_spoken_to_over_verified_tls(
    client: RedisCluster, tls_settings: Settings, tls_cluster: RedisClusterNodes,
) -> None:
    """The jobs' data spreads over all the nodes; each read reaches its node over TLS."""
    names = Names(tls_settings.namespace)
    store = RedisStateStore(client, names, where=where(tls_settings))
    rounds = RoundLog(client, names)
    logs = JobLogStore(client, names)
    for job_id in JOBS:
        submit(store, job_id)
        rounds.append(job_id, {"round": 0, "job": job_id})
        logs.append(job_id, "site-1", CLIENT_JOB, 0, [Line(3, job_id, False)])
    assert {_port_of(client, names.job_rounds_key(job_id)) for job_id in JOBS} == set(
        tls_cluster.ports)
    for job_id in JOBS:
        assert rounds.read(job_id) == [{"round": 0, "job": job_id}]
        assert [entry.line for entry in logs.read(job_id).lines] == [job_id]
    for port in tls_cluster.ports:
        assert _verified_peer(client, port) == NODE_NAMES


def test_a_moved_slot_is_followed_over_verified_tls(
    client: RedisCluster, tls_settings: Settings, tls_cluster: RedisClusterNodes,
) -> None:
    """A slot moves to another node after the clients read the slot map (a resharding, a
    failover): the next command, a MULTI/EXEC or a script, is answered MOVED and goes to the
    new node, over TLS with its certificate verified; the namespace's slot likewise."""
    def empty(key: str) -> bool:  # a slot holding keys (another test's) cannot be moved
        slot = str(key_slot(key.encode()))
        return tls_cluster.cli(_port_of(client, key), "cluster", "countkeysinslot", slot) \
            .strip() == "0"

    names = next(names for names in (Names(f"{tls_settings.namespace}-{i}")
                                     for i in itertools.count())
                 if empty(names.jobs_by_submit_key))
    job_id = next(job for job in (f"moved-{i}" for i in itertools.count())
                  if empty(names.job_rounds_key(job)))
    store = RedisStateStore(client, names, where=where(tls_settings))
    rounds = RoundLog(client, names)
    moves = {}
    for key in (names.job_rounds_key(job_id), names.jobs_by_submit_key):
        owner = _port_of(client, key)
        moves[key] = next(port for port in tls_cluster.ports if port != owner)
        tls_cluster.move_empty_slot(key_slot(key.encode()), moves[key])
    rounds.append(job_id, {"round": 0})  # MULTI/EXEC, answered MOVED
    assert rounds.read(job_id) == [{"round": 0}]
    token = store.acquire("scheduler", "a", 30)  # a script, answered MOVED
    lease = store.get_lease("scheduler")  # MULTI/EXEC on the namespace's new node
    assert lease is not None and lease.token == token
    submit(store, job_id)
    assert store.get_job(job_id).job_id == job_id
    for key, port in moves.items():
        assert _port_of(client, key) == port
        assert _verified_peer(client, port) == NODE_NAMES


@pytest.mark.parametrize("trust", ["another CA", "the system trust store"])
def test_a_certificate_not_accepted_is_one_line_at_first_contact(
    trust: str, tls_settings: Settings, tls_cluster: RedisClusterNodes, client: RedisCluster,
    tmp_path: Path,
) -> None:
    """The cluster client reads the slot map when made: that is where it is refused, once."""
    ca_file = str(CertAuthority.create(tmp_path, "other CA").pem) if trust == "another CA" \
        else None
    first = tls_cluster.ports[0]

    def refused() -> int:
        return tls_cluster.log(first).count(REFUSED)

    before = refused()
    with pytest.raises(ConfigError) as raised:
        redis_client(replace(tls_settings, redis_ca_file=ca_file))
    message = str(raised.value)
    assert message.startswith(f"redis at {where(tls_settings)} refused over TLS: certificate "
                              "verify failed: self-signed certificate in certificate chain")
    assert "FEDHIVE_REDIS_CA_FILE" in message and "\n" not in message
    assert raised.value.field == "FEDHIVE_REDIS_CA_FILE"
    assert client.ping(target_nodes=RedisCluster.ALL_NODES)  # the nodes are fine
    wait_for(lambda: refused() > before, timeout=10, what="the node logging the refusal")
    assert refused() == before + 1  # one handshake: not retried
