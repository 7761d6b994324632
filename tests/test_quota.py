"""The API-quota executor against a real HTTP server on loopback (no mocked httpx).

These run in real time with the server on the same event loop, on machines that other
jobs load. So they assert on the server's own log (its count of 429s, what it accepted
in any window, which key sent what) and on totals, never on tight timings: the client's
safety margin (``Quota(jitter=...)``, the burst it leaves unused) is what keeps a busy
loop from tripping the server, and that margin is what these tests check.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import anyio
import httpx
import pytest

import tangram
from tangram._core._stats import most_in_window
from tangram._quota._adapt import adapt_down, adapt_up, note_accepted
from tangram._quota._keys import DEFAULT_HEADROOM, DEFAULT_JITTER, KeyState
from tangram.quota import (
    Adapt,
    ApiKey,
    Quota,
    QuotaDeadlineError,
    SetAside,
)
from tangram.testing import Limit, QuotaServer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _usage(response: httpx.Response) -> float:
    return float(json.loads(response.content)["usage"]["total_tokens"])


def _key(name: str, **limits: object) -> ApiKey:
    return ApiKey(name=name, headers={"Authorization": f"Bearer {name}"}, **limits)


async def _burst(client: httpx.AsyncClient, n: int, **kwargs: object) -> list[int]:
    codes: list[int] = []

    async def one() -> None:
        response = await client.get("/v1", **kwargs)  # type: ignore[arg-type]
        codes.append(response.status_code)

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)
    return codes


async def _open(
    stack: AsyncExitStack, server: QuotaServer, quota: Quota, **capacity: object
) -> tuple[tangram.Runtime, httpx.AsyncClient]:
    runtime = await stack.enter_async_context(
        tangram.Runtime(capacity=capacity or quota.capacity())
    )
    client = await stack.enter_async_context(quota.client(base_url=server.url))
    return runtime, client


async def test_known_limits_hold_with_no_429() -> None:
    limit = Limit(requests=40, requests_burst=10, concurrency=3)
    quota = Quota([_key("k", requests=tangram.Rate(40, burst=10), concurrency=3)])
    async with QuotaServer(limit, latency=0.03) as server, AsyncExitStack() as stack:
        runtime, client = await _open(stack, server, quota)
        codes = await _burst(client, 80)
        held = runtime.stats().resources["api.k.concurrency"].held
    assert codes == [200] * 80
    assert server.rejected == []
    assert server.peak_in_flight["k"] <= 3
    times = [t for t, _, _ in server.accepted]
    for window in (0.1, 0.5, 1.0):
        assert most_in_window(times, window) <= 40 * window + 10
    assert held == 0


# The most a key adapted to a provider's 30 requests a second may end at. AIMD holds a
# plateau of 99 % of the limit it measured, and the measure counts whole requests over a
# one-second window by their send times (late on a loaded machine): one request more in
# the count is 1/30 of the limit. CI once ended at 30.17 under the bare 30 this asserted.
MEASURED_30 = 30 * (1 + 1 / 30)


async def test_configured_above_real_limit_converges() -> None:
    quota = Quota([_key("k", requests=90)])
    async with (
        QuotaServer(Limit(requests=30, requests_burst=5), latency=0.005) as server,
        AsyncExitStack() as stack,
    ):
        _, client = await _open(stack, server, quota, cpu=1)
        codes = await _burst(client, 150)
    # Every request completes: the 429s were retried.
    assert codes == [200] * 150
    # The effective rate ends at the real limit's plateau, far below the configured 3x.
    assert quota.stats()["k"].rate_share * 90 * DEFAULT_HEADROOM < MEASURED_30
    # Once adapted, 429s stop: none in the last half of the run.
    start, end = server.accepted[0][0], server.accepted[-1][0]
    assert [t for t, _ in server.rejected if t > (start + end) / 2] == []


async def test_aimd_adapts_down_and_back_up() -> None:
    adapt = Adapt(hold=0.3, increase=1.0, cooldown=0.5)
    quota = Quota([_key("k", requests=60)], adapt=adapt)
    shares: list[float] = []

    async def sample() -> None:
        while True:
            shares.append(quota.stats()["k"].rate_share)
            await anyio.sleep(0.01)

    async with (
        QuotaServer(Limit(requests=20, requests_burst=3)) as server,
        anyio.create_task_group() as tg,
        AsyncExitStack() as stack,
    ):
        _, client = await _open(stack, server, quota, cpu=1)
        tg.start_soon(sample)
        # Down: from 3x the real limit to about it (test_configured_above_... pins how
        # far below; here the short hold lets it probe up again soon after). Bursts until
        # it gets there: on a loaded machine the send times it measures the provider's
        # rate by are late, and one burst of 40 may end before the second cut.
        with anyio.fail_after(15):
            while not shares or min(shares) * 60 * DEFAULT_HEADROOM >= 20 * 1.2:
                assert await _burst(client, 40) == [200] * 40
        # Up: the provider raises its limit; after `hold` quiet seconds the rate grows.
        server.set_limit(Limit(requests=1000, requests_burst=3))
        with anyio.fail_after(15):
            while quota.stats()["k"].rate_share < 0.9:
                assert await _burst(client, 10) == [200] * 10
        await stack.aclose()
        tg.cancel_scope.cancel()
    assert quota.stats()["k"].rate_share >= 0.9


async def test_token_weighted_limit_holds_over_any_window() -> None:
    limit = Limit(tokens=4000, tokens_burst=2000)
    quota = Quota([_key("k", tokens=tangram.Rate(4000, burst=2000))], count_tokens=_usage)
    async with QuotaServer(limit) as server, AsyncExitStack() as stack:
        _, client = await _open(stack, server, quota, cpu=1)
        codes: list[int] = []

        async def one(i: int) -> None:
            cost = 100 + 50 * (i % 7)
            response = await client.get(
                "/v1", headers={"X-Tokens": str(cost)}, extensions={"tangram.tokens": cost}
            )
            codes.append(response.status_code)

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(one, i)
    assert codes == [200] * 40
    assert server.rejected == []
    times = [t for t, _, _ in server.accepted]
    weights = [float(w) for _, _, w in server.accepted]
    for window in (0.1, 0.25, 0.5, 1.0, 2.0):
        assert most_in_window(times, window, weights) <= 4000 * window + 2000 + 1e-6


async def test_under_estimate_is_charged_after_the_response() -> None:
    quota = Quota([_key("k", tokens=tangram.Rate(1000, burst=1000))], count_tokens=_usage)
    async with (
        QuotaServer(Limit(tokens=1000, tokens_burst=1000)) as server,
        AsyncExitStack() as stack,
    ):
        runtime, client = await _open(stack, server, quota, cpu=1)
        response = await client.get(
            "/v1", headers={"X-Tokens": "500"}, extensions={"tangram.tokens": 100}
        )
        assert response.status_code == 200
        level = runtime.stats().resources["api.k.tokens"].held
    # 500 charged in all (estimate 100 + 400 taken afterwards), less what refilled since.
    assert level > 400


async def test_keys_used_in_balance() -> None:
    # 20/s a key keeps the shared loop (server and three keys) far from saturation: a
    # starved loop bunches arrivals past any client-side margin.
    quota = Quota([_key(n, requests=tangram.Rate(20, burst=5)) for n in "abc"])
    async with (
        QuotaServer(Limit(requests=20, requests_burst=5), latency=0.01) as server,
        AsyncExitStack() as stack,
    ):
        _, client = await _open(stack, server, quota)
        codes = await _burst(client, 90)
    assert codes == [200] * 90
    assert server.rejected == []
    per_key = {n: sum(1 for _, k, _ in server.accepted if k == n) for n in "abc"}
    assert max(per_key.values()) - min(per_key.values()) <= 6


async def test_failing_key_is_set_aside_then_retried() -> None:
    quota = Quota(
        [_key(n, requests=200) for n in ("good", "bad")],
        set_aside=SetAside(failures=2, cooldown=1.0),
    )
    async with (
        QuotaServer(Limit(requests=200), failing={"bad"}) as server,
        AsyncExitStack() as stack,
    ):
        _, client = await _open(stack, server, quota, cpu=1)
        assert await _burst(client, 40) == [200] * 40
        assert quota.stats()["bad"].set_aside
        # While set aside, nothing goes to it.
        failed_before = len(server.failed)
        assert await _burst(client, 20) == [200] * 20
        assert len(server.failed) == failed_before
        server.failing.clear()
        with anyio.fail_after(10):
            # A stats value with no event to wait on: poll it.
            while quota.stats()["bad"].set_aside:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        for _ in range(10):
            assert (await client.get("/v1")).status_code == 200
    # The cool-down over, one probe went to the healed key, and it is back in use.
    assert any(k == "bad" for _, k, _ in server.accepted)
    assert not quota.stats()["bad"].set_aside


async def test_retry_after_is_honoured() -> None:
    # Configured far above the real 2/s, without AIMD: every other request is refused,
    # and the retry must wait out the server's Retry-After before it is sent again.
    quota = Quota([_key("k", requests=tangram.Rate(50, burst=1))], adapt=None)
    async with (
        QuotaServer(Limit(requests=2, requests_burst=1)) as server,
        AsyncExitStack() as stack,
    ):
        _, client = await _open(stack, server, quota, cpu=1)
        for _ in range(3):
            assert (await client.get("/v1")).status_code == 200
    assert len(server.rejected) >= 1
    arrivals = sorted([t for t, _, _ in server.accepted] + [t for t, _ in server.rejected])
    for refused, _ in server.rejected:
        # One request at a time: the next arrival is this one's retry. The server asked
        # it to wait until its next token (2/s, burst 1); 10 ms for clock rounding.
        last = max(t for t, _, _ in server.accepted if t < refused)
        asked = last + 0.5 - refused
        later = [t for t in arrivals if t > refused]
        assert later and later[0] - refused >= asked - 0.01
    assert quota.stats()["k"].limited == len(server.rejected)


async def test_503_with_retry_after_is_retried_and_adapted_like_429() -> None:
    # A provider that sheds load with 503 + Retry-After instead of 429: every request
    # still completes, and the rate converges below the real limit as it does for 429.
    quota = Quota([_key("k", requests=90)])
    async with (
        QuotaServer(Limit(requests=30, requests_burst=5), latency=0.005, refuse_with=503) as server,
        AsyncExitStack() as stack,
    ):
        _, client = await _open(stack, server, quota, cpu=1)
        codes = await _burst(client, 120)
    assert codes == [200] * 120
    assert server.rejected, "the configured rate is 3x the real one: some must be refused"
    assert quota.stats()["k"].limited == len(server.rejected)
    assert quota.stats()["k"].rate_share * 90 * DEFAULT_HEADROOM < MEASURED_30


async def test_cancelling_a_request_returns_its_slot() -> None:
    quota = Quota([_key("k", concurrency=1)])
    async with (
        QuotaServer(Limit(concurrency=1), latency=10.0) as server,
        AsyncExitStack() as stack,
    ):
        runtime, client = await _open(stack, server, quota, cpu=1)
        for _ in range(2):
            with anyio.move_on_after(0.2):
                await client.get("/v1")
            assert runtime.stats().resources["api.k.concurrency"].held == 0
            assert quota.stats()["k"].in_flight == 0


async def test_deadline_fails_fast() -> None:
    quota = Quota([_key("k", requests=tangram.Rate(2, burst=1))])
    async with QuotaServer(Limit(requests=2)) as server, AsyncExitStack() as stack:
        runtime, client = await _open(stack, server, quota, cpu=1)
        assert (await client.get("/v1")).status_code == 200
        started = anyio.current_time()
        # The next slot is ~0.5 s away: known at once, so it fails well before 0.3 s.
        with pytest.raises(QuotaDeadlineError):
            await client.get("/v1", extensions={"tangram.deadline": 0.3})
        assert anyio.current_time() - started < 0.25
        assert runtime.stats().waiting == 0
    assert issubclass(QuotaDeadlineError, TimeoutError)
    assert issubclass(QuotaDeadlineError, tangram.errors.TangramError)


async def test_nothing_leaks_under_a_cancellation_storm() -> None:
    quota = Quota([_key(n, requests=400, concurrency=4) for n in ("a", "b")])
    async with (
        QuotaServer(Limit(requests=500, concurrency=8), latency=0.02) as server,
        AsyncExitStack() as stack,
    ):
        runtime, client = await _open(stack, server, quota)

        async def one(delay: float) -> None:
            with anyio.move_on_after(delay):
                await client.get("/v1")

        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(one, (i % 10) * 0.005)
        await anyio.sleep(0.05)
        stats = runtime.stats()
    for name in ("api.a.concurrency", "api.b.concurrency"):
        assert stats.resources[name].held == 0
    assert stats.waiting == 0
    assert quota.stats()["a"].in_flight == 0 and quota.stats()["b"].in_flight == 0


# -- AIMD on a virtual clock -------------------------------------------------------------
# `adapt_up`/`adapt_down` take the time as an argument: here a fluid provider (a token
# bucket of rate LIMIT and burst BURST) meets a key with requests always queued, on exact
# virtual times, so convergence and what happens after it are checked without a loop.

LIMIT, BURST, LATENCY, TICK = 50.0, 10.0, 0.02, 0.005


def _provider_run(
    configured: float, adapt: Adapt, seconds: float
) -> tuple[KeyState, list[float], list[float]]:
    """Times of the requests the provider accepted and refused, sent as fast as allowed."""
    key = KeyState("api", _key("k", requests=configured), DEFAULT_HEADROOM, DEFAULT_JITTER)
    runtime = tangram.Runtime(capacity=dict(key.rates()))
    kind = key.requests_kind
    assert kind is not None
    key.waiting_count = 1
    budget, level = 0.0, BURST
    answers: list[tuple[float, float, bool]] = []  # answered at, sent at, accepted
    accepted: list[float] = []
    refused: list[float] = []
    steps = round(seconds / TICK)
    for step in range(steps + 1):
        now = step * TICK
        rate = key.rates()[kind]
        budget = min(rate.burst, budget + rate.per_second * TICK)
        level = min(BURST, level + LIMIT * TICK)
        while budget >= 1.0:
            budget -= 1.0
            ok = level >= 1.0
            level -= 1.0 if ok else 0.0
            (accepted if ok else refused).append(now)
            answers.append((now + LATENCY, now, ok))
        due = [a for a in answers if a[0] <= now]
        answers = [a for a in answers if a[0] > now]
        for _, sent, ok in due:
            if ok:
                note_accepted(key, 0.0, now, sent)
            else:
                adapt_down(adapt, runtime, key, now, sent)
        adapt_up(adapt, runtime, key, now)
    return key, accepted, refused


def _share(accepted: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in accepted) / (end - start) / LIMIT


@pytest.mark.parametrize(
    ("configured", "adapt"),
    [(3 * LIMIT, Adapt()), (LIMIT / 2, Adapt(above=4.0)), (10 * LIMIT, Adapt())],
)
def test_aimd_finds_the_limit_and_holds_it(configured: float, adapt: Adapt) -> None:
    """Within 5 s the key runs at >= 95% of the real limit, and no 429 comes after."""
    _, accepted, refused = _provider_run(configured, adapt, 25.0)
    assert refused  # it had to find the limit
    assert max(refused) < 5.0
    assert 0.95 <= _share(accepted, 5.0, 25.0) <= 1.0


def test_aimd_probes_after_hold_without_losing_the_limit() -> None:
    """Each probe past the plateau costs a few 429s and leaves the estimate where it was.

    Counting the accepted requests from the last cut (as AIMD did) measured the client's
    own rate under the limit, so every probe lowered the estimate: 86.5% of the limit.
    """
    adapt = Adapt(hold=10.0)
    key, accepted, refused = _provider_run(3 * LIMIT, adapt, 120.0)
    late = [t for t in refused if t >= 5.0]
    probes = len({int((t - 5.0) // adapt.hold) for t in late})
    assert 0 < probes <= 12
    assert len(late) <= 12 * probes
    assert _share(accepted, 60.0, 120.0) >= 0.95
    assert 0.95 <= key.refused * 3 * LIMIT * DEFAULT_HEADROOM / LIMIT <= 1.02


def test_configured_rate_is_a_ceiling_unless_above() -> None:
    """By default the configured rate is the provider's promise: never probed past."""
    key, accepted, refused = _provider_run(LIMIT / 2, Adapt(), 10.0)
    assert refused == []
    assert key.share == 1.0
    assert _share(accepted, 2.0, 10.0) == pytest.approx(DEFAULT_HEADROOM / 2, abs=0.01)
