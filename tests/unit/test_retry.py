"""The one backoff policy: capped, jittered, bounded."""

import random

import pytest

from fedhive.retry import Backoff


def test_delays_are_jittered_below_a_growing_cap() -> None:
    policy = Backoff(base=0.1, cap=1.0, max_attempts=None)
    rng = random.Random(7)
    for attempt in range(1, 12):
        ceiling = min(1.0, 0.1 * 2 ** (attempt - 1))
        samples = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(0 <= s <= ceiling for s in samples)
        assert max(samples) > ceiling / 2  # jitter spreads over the range


def test_attempts_are_bounded() -> None:
    assert len(list(Backoff(base=0, max_attempts=4).delays())) == 3


def test_call_retries_then_succeeds_or_raises() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    seen: list[BaseException] = []
    assert Backoff(base=0).call(flaky, (ConnectionError,), lambda e, _w: seen.append(e)) == "ok"
    assert len(calls) == 3 and len(seen) == 2

    def always() -> str:
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        Backoff(base=0, max_attempts=3).call(always, (ConnectionError,))


def test_other_errors_are_not_retried() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise ValueError("bug")

    with pytest.raises(ValueError):
        Backoff(base=0).call(broken, (ConnectionError,))
    assert len(calls) == 1
