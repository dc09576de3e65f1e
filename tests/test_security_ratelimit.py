"""Token buckets with an injected clock."""

import math

import pytest

from agora.trust.ratelimit import RateLimiter, TokenBucket


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_burst_then_sustained_rate():
    clock = Clock()
    lim = RateLimiter(rate=2.0, burst=4.0, clock=clock)
    assert [lim.allow("a") for _ in range(5)] == [True] * 4 + [False]
    assert lim.refused == {"a": 1}
    assert lim.retry_after("a") == pytest.approx(0.5)
    clock.t += 0.5
    assert lim.allow("a") and not lim.allow("a")
    clock.t += 10  # refills to the burst, not beyond
    assert sum(lim.allow("a") for _ in range(10)) == 4


def test_callers_are_independent_and_costs_weigh():
    lim = RateLimiter(rate=1.0, burst=10.0, clock=Clock())
    assert lim.allow("a", cost=10) and not lim.allow("a", cost=1)
    assert lim.allow("b", cost=6)
    assert not lim.allow("b", cost=5)  # a refused call takes nothing
    assert lim.allow("b", cost=4)
    assert math.isinf(lim.retry_after("c", cost=11))  # more than the burst: never


def test_lru_eviction_is_bounded_and_exact():
    clock = Clock()
    lim = RateLimiter(rate=1.0, burst=2.0, max_callers=3, clock=clock)
    for name in "abcd":
        lim.allow(name)
    assert len(lim) == 3  # "a" evicted; it comes back with a full bucket
    assert lim.allow("a") and lim.allow("a") and not lim.allow("a")


def test_time_going_backwards_does_not_mint_tokens():
    b = TokenBucket(rate=1.0, burst=1.0, tokens=0.0, updated=10.0)
    assert not b.take(1.0, now=5.0)
    assert b.take(1.0, now=11.0)


def test_bad_parameters():
    with pytest.raises(ValueError):
        RateLimiter(rate=-1, burst=1)
    with pytest.raises(ValueError):
        RateLimiter(rate=1, burst=0)
