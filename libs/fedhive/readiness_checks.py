"""The readiness checks a composition root picks from (`fedhive.readiness` runs them).

* `consuming(*consumers)` ("broker"): each consumer's channel is open and its consumer
  registered, the proof that commands reach the service.
* `broker_link(settings, name)` ("broker"): for a service that only publishes or calls, a
  connection of the check's own to the broker is open (reconnected when lost).
* `redis_answers(settings)` ("redis"): PING within the timeout.
* `bucket_answers(settings)` ("s3"): HEAD of the bucket within the timeout (reachable,
  credentials accepted, bucket there).
* `published_within(...)`: something the service must keep publishing (a site's heartbeats)
  was published recently.

Each check holds a small client of its own with short timeouts, so a probe never waits behind
the service's own traffic or retries; `Readiness` bounds every probe besides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions

from fedhive.bus.connection import connection_parameters
from fedhive.bus.port import Subscription
from fedhive.config import Settings
from fedhive.readiness import DEFAULT_TIMEOUT_S, Check


class NotReady(Exception):
    """A check's answer: its message says what is not usable."""


def consuming(*consumers: Subscription) -> Check:
    def probe() -> str:
        stalled = [consumer.queue for consumer in consumers if not consumer.consuming]
        if stalled:
            raise NotReady(f"not consuming from {', '.join(stalled)} (reconnecting, or the "
                           "broker closed its channel or cancelled its consumer)")
        return "consuming from " + ", ".join(consumer.queue for consumer in consumers)

    return Check("broker", probe)


class _BrokerLink:
    def __init__(self, settings: Settings, name: str, timeout_s: float) -> None:
        self._params = connection_parameters(settings.amqp_url, name=name,
                                             ca_file=settings.amqp_ca_file)
        self._params.socket_timeout = timeout_s
        self._params.stack_timeout = 2 * timeout_s
        self._where = f"RabbitMQ at {self._params.host}:{self._params.port}"
        self._connection: pika.BlockingConnection | None = None

    def probe(self) -> str:
        connection = self._connection
        if connection is not None and connection.is_open:
            try:
                connection.process_data_events(time_limit=0)  # heartbeats; notices a lost link
                return f"connected to {self._where}"
            except (pika.exceptions.AMQPError, OSError):
                pass
        self._connection = None
        try:
            self._connection = pika.BlockingConnection(self._params)
        except (pika.exceptions.AMQPError, OSError) as err:
            raise NotReady(f"{self._where}: {err!r}") from None
        return f"connected to {self._where}"

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and connection.is_open:
            connection.close()


def broker_link(settings: Settings, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Check:
    """`name`: the connection's name in the broker's management UI."""
    link = _BrokerLink(settings, name, timeout_s)
    return Check("broker", link.probe, link.close)


def redis_answers(settings: Settings, timeout_s: float = DEFAULT_TIMEOUT_S) -> Check:
    from fedhive.state.connect import redis_client, where

    client: list[Any] = []  # made by the first probe: a cluster client contacts Redis

    def probe() -> str:
        try:
            if not client:
                client.append(redis_client(settings, socket_timeout=timeout_s,
                                           connect_timeout=timeout_s))
            client[0].ping()
        except Exception as err:
            raise NotReady(f"redis at {where(settings)}: {err}") from None
        return f"PONG from {where(settings)}"

    def close() -> None:
        for each in client:
            each.close()

    return Check("redis", probe, close)


def bucket_answers(settings: Settings, timeout_s: float = DEFAULT_TIMEOUT_S) -> Check:
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(
        aws_access_key_id=settings.aws_access_key_id,
        aws_secret_access_key=settings.aws_secret_access_key,
        aws_session_token=settings.aws_session_token,
        region_name=settings.s3_region,
    )
    config = Config(signature_version="s3v4", retries={"total_max_attempts": 1},
                    s3={"addressing_style": "path" if settings.s3_endpoint_url else "auto"},
                    connect_timeout=timeout_s, read_timeout=timeout_s, max_pool_connections=1)
    bucket = settings.s3_bucket
    where = f"bucket {bucket} at {settings.s3_endpoint_url or 'AWS S3'}"
    clients: list[Any] = []  # made by the first probe: resolving credentials may fail too

    def probe() -> str:
        try:
            if not clients:
                clients.append(session.client("s3", endpoint_url=settings.s3_endpoint_url,
                                              config=config))
            clients[0].head_bucket(Bucket=bucket)
        except Exception as err:
            raise NotReady(f"{where}: {err}") from None
        return f"{where} answers"

    def close() -> None:
        for client in clients:
            client.close()

    return Check("s3", probe, close)


def published_within(name: str, last: Callable[[], float | None], within_s: float,
                     what: str) -> Check:
    """`last()`: `time.monotonic()` of the latest publish the broker confirmed, None if none."""
    def probe() -> str:
        at = last()
        if at is None:
            raise NotReady(f"no {what} published yet")
        age = time.monotonic() - at
        if age > within_s:
            raise NotReady(f"no {what} published for {age:.0f}s (limit {within_s:g}s)")
        return f"{what} published {age:.0f}s ago"

    return Check(name, probe)
