"""`fedhive-job-store`: job definitions, validation, status history.

The composition root: builds the state store and the round log (Redis), the blob store (S3,
bucket ensured), the bus (RabbitMQ) and serves `{ns}.job-store` with the handlers of
`handlers.py`. Stateless: run as many replicas as wanted; everything lives in Redis, S3 and
the durable queue.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fedhive.blobs import S3BlobStore
from fedhive.bus import Consumer, RabbitBus
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.readiness import Check
from fedhive.readiness_checks import bucket_answers, consuming, redis_answers
from fedhive.service import run
from fedhive.state import RedisStateStore
from fedhive.state.joblogs import JobLogStore
from fedhive.state.rounds import RoundLog

from .context import JobStoreContext
from .handlers import ACCEPTS, SERVICE, make_handler

CONCURRENCY = 4  # requests handled at once; mostly waiting on Redis and S3
PREFETCH = 8


@dataclass
class JobStoreService:
    bus: RabbitBus
    state: RedisStateStore
    blobs: S3BlobStore
    rounds: RoundLog
    logs: JobLogStore
    settings: Settings
    consumer: Consumer

    def ready_checks(self) -> list[Check]:
        return [consuming(self.consumer), redis_answers(self.settings),
                bucket_answers(self.settings)]

    def close(self) -> None:
        """Stop consuming (running requests finish and are acked), then release the ports."""
        self.bus.close()
        self.state.close()
        self.rounds.close()
        self.logs.close()
        self.blobs.close()


def build(settings: Settings, log: Any) -> JobStoreService:
    names = Names(settings.namespace)
    state = RedisStateStore.from_settings(settings)
    blobs = S3BlobStore.from_settings(settings)
    blobs.ensure_bucket()
    rounds = RoundLog.from_settings(settings)
    logs = JobLogStore.from_settings(settings)
    bus = RabbitBus(settings, name=SERVICE)
    try:
        ctx = JobStoreContext(state=state, blobs=blobs, events=bus, runner=bus, names=names,
                              rounds=rounds, logs=logs)
        consumer = bus.serve(
            names.service_queue(SERVICE),
            make_handler(ctx),
            ACCEPTS,
            prefetch=PREFETCH,
            concurrency=CONCURRENCY,
        )
    except BaseException:
        bus.close()
        raise
    log.info("job_store.serving", queue=names.service_queue(SERVICE))
    return JobStoreService(bus, state, blobs, rounds, logs, settings, consumer)


def main(argv: Sequence[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="fedhive-job-store",
        description="fedhive job store: job definitions, validation and status history. "
        "Broker, Redis, S3 and namespace come from FEDHIVE_* (and AWS_*) variables; it takes "
        "no options.").parse_args(argv)
    run("fedhive-job-store", build)


if __name__ == "__main__":
    main()
