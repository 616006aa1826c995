"""Heartbeat intake: verify who sent a site event, store it, and derive registry transitions.

Transport-free: `accept` turns one delivered event into a `SiteEvent` (or refuses it), `store`
writes a batch of them through the `SitePresence` port and `sweep` finds expired sites; both
return the `Transition`s the caller publishes (`site.online` / `site.offline`, payload the
SiteHeartbeat). Which caller sees a transition is decided atomically in the store, so several
intake replicas, or one restarted, announce each transition once.

Sender identity: a site publishes on `site.<site>.<kind>` with the AMQP `user_id` property,
which RabbitMQ verifies against the connection's user (the site's own broker user,
`Names.site_user`). The intake accepts an event only when the `user_id` is the broker user of
the site in the routing key and that site is the one in the payload; a site holding its own
credentials cannot speak for another.

Times: `sent_at_ms` orders one site's events (a beat older than the site's last recorded one is
stale and ignored). An event without it (0) is stamped with the intake's clock on arrival.

Verdicts on absence (a site's record expired, a client job's beats stopped) are only as good as
the data behind them: while the intake's consumer is cut off from the broker, or the store does
not answer, beats that were sent are missing, not late. `Vigil` says when a judge may take such
verdicts: its own consumer has consumed without a break, and the store has answered every call,
for at least the verdict's TTL (`site_ttl_s` / `job_ttl_s`); after a reconnect, verdicts wait
until a whole TTL of fresh beats could have arrived. With several intake replicas each judges
only on its own vigil: the queue is shared, so one replica that is cut off receives nothing
while the others receive everything, and their store writes make the records whole again; a
replica never trusts another's connection, only the store's records and its own continuity.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from google.protobuf.message import Message

from fedhive.errors import MalformedMessage, PermissionDenied
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2
from fedhive.sites.heartbeat import JobHeartbeat, SiteHeartbeat
from fedhive.sites.serde import job_heartbeat_from_proto, site_heartbeat_from_proto
from fedhive.state import SitePresence

Kind = Literal["heartbeat", "online", "offline", "job"]
SITE_KINDS: tuple[Kind, ...] = ("heartbeat", "online", "offline")

_KINDS: dict[str, Kind] = {kind: kind for kind in (*SITE_KINDS, "job")}

# What the intake's events queue is bound to.
PATTERNS: tuple[str, ...] = tuple(Names.site_event("*", kind) for kind in _KINDS)


@dataclass(frozen=True)
class IntakeConfig:
    """`site_ttl_s`: how long a site stays live after its last heartbeat (the liveness window,
    e.g. 3 x the agents' heartbeat interval); `job_ttl_s` the same for a client job's beat;
    `sweep_interval_s`: how often expired sites are looked for."""

    site_ttl_s: float = 15.0
    job_ttl_s: float = 15.0
    sweep_interval_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("site_ttl_s", "job_ttl_s", "sweep_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class Vigil:
    """Since when a judge's view of site liveness is whole. The store's side is told here
    (`store_answered` after every successful call, `store_failed` after a failed one); the
    consumer's side is its `consuming_since` (monotonic; None while it reconnects)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._store_since: float | None = None  # None: no answer since the last failure

    def store_answered(self) -> None:
        with self._lock:
            if self._store_since is None:
                self._store_since = self._clock()

    def store_failed(self) -> None:
        with self._lock:
            self._store_since = None

    def whole_for(self, consuming_since: float | None) -> float:
        """How long (seconds) both the consumer and the store have been there without a
        break; 0 while either is not."""
        with self._lock:
            store_since = self._store_since
        if consuming_since is None or store_since is None:
            return 0.0
        return max(0.0, self._clock() - max(consuming_since, store_since))

    def trusts(self, consuming_since: float | None, window_s: float) -> bool:
        """Whether an absence over the last `window_s` seconds is real, not a gap in the view."""
        return self.whole_for(consuming_since) >= window_s


@dataclass(frozen=True)
class SiteEvent:
    kind: Kind
    site: str
    beat: SiteHeartbeat | None = None  # for heartbeat/online/offline
    job_beat: JobHeartbeat | None = None  # for job


@dataclass(frozen=True)
class Transition:
    routing_key: str  # Names.SITE_ONLINE or Names.SITE_OFFLINE
    beat: SiteHeartbeat

    @property
    def message_id(self) -> str:
        """Stable per transition, so a consumer can drop a re-published duplicate."""
        return f"{self.routing_key}:{self.beat.site}:{self.beat.sent_at_ms}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def parse_routing_key(routing_key: str) -> tuple[str, Kind]:
    """`site.<site>.<kind>` -> (site, kind); MalformedMessage for anything else."""
    parts = routing_key.split(".")
    if len(parts) != 3 or parts[0] != "site" or not parts[1]:
        raise MalformedMessage(f"routing key {routing_key!r} is not site.<site>.<kind>",
                               field="routing_key")
    kind = _KINDS.get(parts[2])
    if kind is None:
        raise MalformedMessage(f"routing key {routing_key!r}: unknown event kind {parts[2]!r}",
                               field="routing_key")
    return parts[1], kind


def accept(message: Message, routing_key: str, user_id: str | None, names: Names) -> SiteEvent:
    """Verify one delivered site event and decode it.

    PermissionDenied (naming the sender and the claimed site) when `user_id` is not the broker
    user of the routing key's site, or the payload names another site; MalformedMessage when the
    routing key or the payload type does not fit.
    """
    site, kind = parse_routing_key(routing_key)
    if kind == "job":
        if not isinstance(message, site_pb2.JobHeartbeat):
            raise MalformedMessage(f"{routing_key} carries a {type(message).__name__}, not a "
                                   f"JobHeartbeat", field="type")
        claimed = message.site
    else:
        if not isinstance(message, site_pb2.SiteHeartbeat):
            raise MalformedMessage(f"{routing_key} carries a {type(message).__name__}, not a "
                                   f"SiteHeartbeat", field="type")
        claimed = message.site
    if user_id != names.site_user(site) or claimed != site:
        raise PermissionDenied(
            f"{routing_key} refused: sent by broker user {user_id or '(none)'!r} for site "
            f"{site!r} with payload site {claimed!r}; the sender must be the site's broker "
            f"user {names.site_user(site)!r} and the payload name the site",
            field="user_id",
        )
    if isinstance(message, site_pb2.JobHeartbeat):
        if not message.job_id:
            raise MalformedMessage(f"{routing_key}: job heartbeat without job_id",
                                   field="job_id")
        job_beat = job_heartbeat_from_proto(message)
        if not job_beat.sent_at_ms:
            job_beat = replace(job_beat, sent_at_ms=_now_ms())
        return SiteEvent(kind, site, job_beat=job_beat)
    beat = site_heartbeat_from_proto(message)
    if not beat.sent_at_ms:
        beat = replace(beat, sent_at_ms=_now_ms())
    return SiteEvent(kind, site, beat=beat)


def store(
    presence: SitePresence, events: Sequence[SiteEvent], config: IntakeConfig
) -> list[Transition]:
    """Write a batch of accepted events (one round trip per kind) and return its transitions.

    Heartbeats and online announcements are stored as live records; goodbyes take their site
    offline; job beats are kept per (job, site). Order inside a batch does not matter: each
    site's events are ordered by their `sent_at_ms`.
    """
    live = [e.beat for e in events if e.kind in ("heartbeat", "online") and e.beat]
    goodbyes = [e.beat for e in events if e.kind == "offline" and e.beat]
    job_beats = [e.job_beat for e in events if e.job_beat]
    transitions: list[Transition] = []
    if live:
        newest: dict[str, SiteHeartbeat] = {}
        for beat in live:
            if beat.sent_at_ms >= newest.get(beat.site, beat).sent_at_ms:
                newest[beat.site] = beat
        born = presence.record_heartbeats(live, config.site_ttl_s)
        transitions += [Transition(Names.SITE_ONLINE, newest[site]) for site in born]
    for beat in goodbyes:
        if presence.mark_offline(beat):
            transitions.append(Transition(Names.SITE_OFFLINE, beat))
    if job_beats:
        presence.record_job_heartbeats(job_beats, config.job_ttl_s)
    return transitions


def sweep(presence: SitePresence) -> list[Transition]:
    """`site.offline` for each site whose live record expired since the last sweep (by anyone)."""
    return [Transition(Names.SITE_OFFLINE, beat) for beat in presence.sweep_expired()]
