"""Contract of leases with fencing tokens; runs against Redis and the in-memory store."""

from __future__ import annotations

import pytest

from fedhive.errors import LeaseNotHeld
from fedhive.state import StateStore
from tests.fixtures.infra import wait_for


def test_acquire_is_exclusive_and_reentrant(state_store: StateStore) -> None:
    token = state_store.acquire("scheduler", "a", 30)
    assert token is not None
    assert state_store.acquire("scheduler", "b", 30) is None
    assert state_store.acquire("scheduler", "a", 30) == token  # the holder again: same token
    lease = state_store.get_lease("scheduler")
    assert lease is not None and (lease.holder, lease.token) == ("a", token)
    assert 0 < lease.expires_in_s <= 30


def test_tokens_are_per_lease_name(state_store: StateStore) -> None:
    first = state_store.acquire("job:1", "runner-1", 30)
    other = state_store.acquire("job:2", "runner-1", 30)
    assert first is not None and other is not None
    assert state_store.get_lease("job:1") is not None and state_store.get_lease("job:3") is None


def test_renew_extends_only_for_the_holder(state_store: StateStore) -> None:
    token = state_store.acquire("scheduler", "a", 30)
    assert token is not None
    state_store.renew("scheduler", "a", token, 60)
    lease = state_store.get_lease("scheduler")
    assert lease is not None and lease.expires_in_s > 30
    with pytest.raises(LeaseNotHeld, match="scheduler"):
        state_store.renew("scheduler", "b", token, 60)
    with pytest.raises(LeaseNotHeld):
        state_store.renew("scheduler", "a", token + 1, 60)


def test_expiry_and_takeover_give_a_higher_token(state_store: StateStore) -> None:
    old = state_store.acquire("scheduler", "a", 0.2)
    assert old is not None
    wait_for(lambda: state_store.get_lease("scheduler") is None, timeout=5, what="lease expiry")
    new = state_store.acquire("scheduler", "b", 30)
    assert new is not None and new > old
    with pytest.raises(LeaseNotHeld, match="no longer held by a"):
        state_store.renew("scheduler", "a", old, 30)
    assert state_store.release("scheduler", "a", old) is False
    lease = state_store.get_lease("scheduler")
    assert lease is not None and (lease.holder, lease.token) == ("b", new)


def test_lapsed_lease_nobody_took_can_be_renewed(state_store: StateStore) -> None:
    token = state_store.acquire("scheduler", "a", 0.2)
    assert token is not None
    wait_for(lambda: state_store.get_lease("scheduler") is None, timeout=5, what="lease expiry")
    state_store.renew("scheduler", "a", token, 30)
    lease = state_store.get_lease("scheduler")
    assert lease is not None and (lease.holder, lease.token) == ("a", token)
    assert state_store.acquire("scheduler", "b", 30) is None


def test_release_then_acquire_gives_a_higher_token(state_store: StateStore) -> None:
    first = state_store.acquire("scheduler", "a", 30)
    assert first is not None
    assert state_store.release("scheduler", "a", first) is True
    assert state_store.get_lease("scheduler") is None
    second = state_store.acquire("scheduler", "a", 30)
    assert second is not None and second > first


def test_take_over_fences_the_previous_holder_out(state_store: StateStore) -> None:
    old = state_store.acquire("runner:r", "a", 30)
    assert old is not None
    assert state_store.take_over("runner:r", "c", 30, previous="b") is None  # a holds it
    new = state_store.take_over("runner:r", "b", 30, previous="a")
    assert new is not None and new > old
    with pytest.raises(LeaseNotHeld, match="no longer held by a"):
        state_store.renew("runner:r", "a", old, 30)
    assert state_store.release("runner:r", "a", old) is False
    lease = state_store.get_lease("runner:r")
    assert lease is not None and (lease.holder, lease.token) == ("b", new)
    again = state_store.take_over("runner:r", "b", 30, previous="a")  # by the holder itself
    assert again is not None and again > new
    with pytest.raises(LeaseNotHeld):
        state_store.renew("runner:r", "b", new, 30)
    assert state_store.take_over("job:free", "b", 30, previous="a") is not None


def test_a_lease_taken_over_is_not_taken_back_after_it_lapsed(state_store: StateStore) -> None:
    old = state_store.acquire("runner:r", "a", 30)
    new = state_store.take_over("runner:r", "a", 0.2, previous="a")
    assert old is not None and new is not None and new > old
    wait_for(lambda: state_store.get_lease("runner:r") is None, timeout=5, what="lease expiry")
    with pytest.raises(LeaseNotHeld):
        state_store.renew("runner:r", "a", old, 30)
    state_store.renew("runner:r", "a", new, 30)
