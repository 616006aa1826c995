"""The job-runner's heartbeat intake: consume site events, store them, announce transitions.

Consumes `site.*.{heartbeat,online,offline,job}` on the events queue
`Names.events_queue("heartbeats")` (shared by every job-runner replica: each event is handled
once) with `Bus.subscribe_batches`: deliveries gathered for up to 0.1 s are verified one by one
(`fedhive.sites.intake.accept`), written in one Redis script call, the `site.online` /
`site.offline` transitions they produced are published, and the batch is acked with one frame.
A sweeper thread looks for sites whose record expired.

Refused events (sender's broker user, routing key and payload naming different sites;
malformed routing key or payload) are dropped — acked, not dead-lettered — with one warning
line naming the sender and the claimed site: a site can only ever publish as itself, so the log
line attributes the attempt, and a dead-letter queue would only let a misbehaving site fill it.
A store that is unavailable fails the batch: it is requeued and redelivered.
"""

from __future__ import annotations

import threading
from typing import Any

from fedhive.bus import Batch, Bus, Subscription
from fedhive.errors import MalformedMessage, PermissionDenied
from fedhive.proto.v1 import site_pb2
from fedhive.sites import intake
from fedhive.sites.intake import IntakeConfig, SiteEvent, Transition
from fedhive.sites.serde import site_heartbeat_to_proto
from fedhive.state import SitePresence

CONSUMER = "heartbeats"
MAX_BATCH = 500
BATCH_WAIT_S = 0.1  # how long a batch gathers: heartbeats need no faster ack


class HeartbeatIntake:
    """Started by `start()`, stopped by `close()`; the bus and the store belong to the caller."""

    def __init__(
        self, bus: Bus, presence: SitePresence, config: IntakeConfig, log: Any
    ) -> None:
        self._bus = bus
        self._presence = presence
        self._config = config
        self._log = log.bind(component="heartbeat-intake")
        self._consumer: Subscription | None = None
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="heartbeat-sweeper",
                                         daemon=True)

    def start(self) -> None:
        self._sweeper.start()
        self._consumer = self._bus.subscribe_batches(
            CONSUMER, intake.PATTERNS, self.handle_batch,
            [site_pb2.SiteHeartbeat, site_pb2.JobHeartbeat],
            max_batch=MAX_BATCH, max_wait_s=BATCH_WAIT_S,
        )
        self._log.info("heartbeat_intake.started", site_ttl_s=self._config.site_ttl_s,
                       sweep_interval_s=self._config.sweep_interval_s)

    def close(self) -> None:
        self._stop.set()
        if self._consumer is not None:
            self._consumer.stop()
        if self._sweeper.is_alive():
            self._sweeper.join()

    # consumer thread ----------------------------------------------------------------------
    def handle_batch(self, batch: Batch) -> None:
        events: list[SiteEvent] = []
        for message, delivery in batch:
            try:
                events.append(intake.accept(message, delivery.routing_key, delivery.user_id))
            except (PermissionDenied, MalformedMessage) as err:
                self._log.warning("heartbeat_refused", sender=delivery.user_id,
                                  routing_key=delivery.routing_key, code=err.code,
                                  error=str(err))
        self._announce(intake.store(self._presence, events, self._config))

    def _announce(self, transitions: list[Transition]) -> None:
        for transition in transitions:
            beat = transition.beat
            try:
                self._bus.publish_event(transition.routing_key, site_heartbeat_to_proto(beat),
                                        message_id=transition.message_id)
            except Exception as err:  # stored already; a later transition will correct it
                self._log.error("site_transition_not_published", site=beat.site,
                                transition=transition.routing_key, error=str(err))
                continue
            self._log.info("site_transition", site=beat.site,
                           transition=transition.routing_key, org=beat.org)

    # sweeper thread -----------------------------------------------------------------------
    def _sweep_loop(self) -> None:
        while not self._stop.wait(self._config.sweep_interval_s):
            try:
                self._announce(intake.sweep(self._presence))
            except Exception as err:  # the next sweep tries again
                self._log.warning("heartbeat_sweep_failed", error=str(err))
