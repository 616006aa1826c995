"""The one retry/backoff policy: exponential with full jitter, capped, bounded in attempts or time.

Used by the bus (reconnects, republishing), the blob store (transient S3 errors) and any
service loop that waits on infrastructure.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    base: float = 0.1  # seconds before the first retry (before jitter)
    cap: float = 5.0  # no single wait exceeds this
    max_attempts: int | None = 8  # None: retry until `deadline`
    deadline: float | None = None  # total seconds across attempts; None: no limit

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Wait before retry number `attempt` (1-based): uniform in [0, min(cap, base*2^(n-1))]."""
        ceiling = min(self.cap, self.base * (2 ** (attempt - 1)))
        return (rng or random).uniform(0, ceiling)

    def delays(self) -> Iterator[float]:
        """Yield the wait before each retry; stops when attempts or time run out."""
        start = time.monotonic()
        attempt = 1
        while self.max_attempts is None or attempt < self.max_attempts:
            wait = self.delay(attempt)
            if self.deadline is not None:
                left = self.deadline - (time.monotonic() - start)
                if left <= 0:
                    return
                wait = min(wait, left)
            yield wait
            attempt += 1

    def call(
        self,
        fn: Callable[[], T],
        retry_on: tuple[type[BaseException], ...],
        on_retry: Callable[[BaseException, float], None] | None = None,
    ) -> T:
        """Call `fn`, retrying on `retry_on` errors; the last error propagates."""
        delays = self.delays()
        while True:
            try:
                return fn()
            except retry_on as err:
                wait = next(delays, None)
                if wait is None:
                    raise
                if on_retry is not None:
                    on_retry(err, wait)
                time.sleep(wait)
