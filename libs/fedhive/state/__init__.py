"""State in Redis: job records and the status state machine, leases, heartbeats, idempotency.

Services depend on the protocols of `fedhive.state.port`; their composition root builds
`RedisStateStore.from_settings(settings)`.
"""

from fedhive.state.port import (
    Fence,
    Idempotency,
    JobStore,
    JobUpdate,
    Lease,
    Leases,
    SitePresence,
    SiteRegistry,
    StateStore,
)
from fedhive.state.redis_store import RedisStateStore

__all__ = [
    "Fence",
    "Idempotency",
    "JobStore",
    "JobUpdate",
    "Lease",
    "Leases",
    "RedisStateStore",
    "SitePresence",
    "SiteRegistry",
    "StateStore",
]
