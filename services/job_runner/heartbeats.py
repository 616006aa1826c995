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

The intake keeps this process's `Vigil` (`fedhive.sites.intake`): the sweeper announces a site
offline only while `trusts(site_ttl_s)`, i.e. the consumer has consumed without a break and
Redis has answered for a whole site TTL (a site's expired record means nothing while the beats
could not get in), and the job monitor asks the same of its verdicts. While it does not trust
its view the sweeper still probes Redis, so an answering store is noticed without any beats.
"""

from __future__ import annotations

import threading
from typing import Any

import redis

from fedhive.bus import Batch, Bus, Senders, Subscription
from fedhive.errors import MalformedMessage, PermissionDenied, Unavailable
from fedhive.proto.v1 import site_pb2
from fedhive.sites import intake
from fedhive.sites.intake import IntakeConfig, SiteEvent, Transition, Vigil
from fedhive.sites.serde import site_heartbeat_to_proto
from fedhive.state import SitePresence

CONSUMER = "heartbeats"
MAX_BATCH = 500
BATCH_WAIT_S = 0.1  # how long a batch gathers: heartbeats need no faster ack
# What a call cut off from Redis raises: the state port's Unavailable (the bus's too: cut off
# from the broker is as much a gap), or redis-py's own errors from the running-jobs table
# (`fedhive.state.runs`), which is not behind the port.
STORE_ERRORS = (Unavailable, redis.RedisError)


class HeartbeatIntake:
    """Started by `start()`, stopped by `close()`; the bus and the store belong to the caller."""

    def __init__(
        self, bus: Bus, presence: SitePresence, config: IntakeConfig, log: Any
    ) -> None:
        self._bus = bus
        self._names = bus.names
        self._presence = presence
        self.config = config
        self.vigil = Vigil()
        self._log = log.bind(component="heartbeat-intake")
        self._consumer: Subscription | None = None
        self._trusted = False  # what the sweeper last logged: at start, not yet
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="heartbeat-sweeper",
                                         daemon=True)

    def start(self) -> None:
        self._consumer = self._bus.subscribe_batches(
            CONSUMER, intake.PATTERNS, self.handle_batch,
            [site_pb2.SiteHeartbeat, site_pb2.JobHeartbeat],
            senders=Senders.any_site(self._names), max_batch=MAX_BATCH, max_wait_s=BATCH_WAIT_S,
        )
        self._sweeper.start()
        self._log.info("heartbeat_intake.started", site_ttl_s=self.config.site_ttl_s,
                       sweep_interval_s=self.config.sweep_interval_s)

    @property
    def subscription(self) -> Subscription | None:
        """Its consumer, once started (the runner's readiness check)."""
        return self._consumer

    def close(self) -> None:
        self._stop.set()
        if self._consumer is not None:
            self._consumer.stop()
        if self._sweeper.is_alive():
            self._sweeper.join()

    def trusts(self, window_s: float) -> bool:
        """Whether this process saw every beat of the last `window_s` seconds (see module)."""
        since = self._consumer.consuming_since if self._consumer is not None else None
        return self.vigil.trusts(since, window_s)

    # consumer thread ----------------------------------------------------------------------
    def handle_batch(self, batch: Batch) -> None:
        events: list[SiteEvent] = []
        for message, delivery in batch:
            try:
                events.append(intake.accept(message, delivery.routing_key, delivery.user_id,
                                            self._names))
            except (PermissionDenied, MalformedMessage) as err:
                self._log.warning("heartbeat_refused", sender=delivery.user_id,
                                  routing_key=delivery.routing_key, code=err.code,
                                  error=str(err))
        try:
            transitions = intake.store(self._presence, events, self.config)
        except STORE_ERRORS:
            self.vigil.store_failed()
            raise
        self.vigil.store_answered()
        self._announce(transitions)

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
        while not self._stop.wait(self.config.sweep_interval_s):
            trusted = self.trusts(self.config.site_ttl_s)
            self._log_trust(trusted)
            try:
                if trusted:
                    self._announce(intake.sweep(self._presence))
                else:  # a probe: tells the vigil the store answers, sweeps nothing
                    self._presence.online_sites()
            except Exception as err:  # the next sweep tries again
                if isinstance(err, STORE_ERRORS):
                    self.vigil.store_failed()
                self._log.warning("heartbeat_sweep_failed", error=str(err))
            else:
                self.vigil.store_answered()

    def _log_trust(self, trusted: bool) -> None:
        if trusted == self._trusted:
            return
        self._trusted = trusted
        if trusted:
            self._log.info("heartbeat_intake.verdicts_resumed", window_s=self.config.site_ttl_s)
        else:
            self._log.warning("heartbeat_intake.verdicts_paused",
                              why="the intake's consumer or Redis was away within the last "
                              "site TTL: a record that expired meanwhile proves nothing")
